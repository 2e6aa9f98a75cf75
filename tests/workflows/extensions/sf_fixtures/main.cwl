cwlVersion: v1.2
class: Workflow
doc: Rounds of round.cwl (cwltool:Loop) while the aggregate step says go.
$namespaces: {cwltool: "http://commonwl.org/cwltool#"}
requirements: {SubworkflowFeatureRequirement: {}}
inputs: {max_rounds: int, min_sites: int, limit: int, model: Directory, ctl: string,
         train_sh: File, aggregate_py: File}
outputs:
  model: {type: Directory, outputSource: rounds/model}
steps:
  rounds:
    run: round.cwl
    in: {round: {default: 1}, go: {default: true}, max_rounds: max_rounds, min_sites: min_sites,
         limit: limit, model: model, ctl: ctl, train_sh: train_sh, aggregate_py: aggregate_py}
    out: [model, next_round, go]
    requirements:
      cwltool:Loop:
        loopWhen: $(inputs.go)
        loop: {round: next_round, model: model, go: go}
        outputMethod: last
