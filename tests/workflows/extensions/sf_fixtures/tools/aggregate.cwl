cwlVersion: v1.2
class: CommandLineTool
doc: The coordinator's step (tools/aggregate.py); each site's update under its own name.
baseCommand: [python3]
arguments: [$(inputs.script.path)]
inputs:
  script: File
  round: {type: int, inputBinding: {prefix: --round}}
  max_rounds: {type: int, inputBinding: {prefix: --max-rounds}}
  min_sites: {type: int, inputBinding: {prefix: --min-sites}}
  update_a: {type: Directory?, inputBinding: {prefix: --update=a=, separate: false}}
  update_b: {type: Directory?, inputBinding: {prefix: --update=b=, separate: false}}
outputs: {model: Directory, next_round: int, go: boolean}
