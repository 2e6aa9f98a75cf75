cwlVersion: v1.2
class: CommandLineTool
doc: A site's round (tools/train.sh).
requirements:
  ToolTimeLimit: {timelimit: $(inputs.limit)}
baseCommand: [bash]
arguments: [$(inputs.script.path)]
inputs:
  script: File
  limit: int
  site: {type: string, inputBinding: {position: 1}}
  round: {type: int, inputBinding: {position: 2}}
  model: {type: Directory, inputBinding: {position: 3}}
  ctl: {type: string, inputBinding: {position: 4}}
outputs:
  update: {type: Directory, outputBinding: {glob: update}}
