cwlVersion: v1.2
class: Workflow
doc: Sites a and b train, the coordinator aggregates what came back.
inputs: {round: int, go: boolean, max_rounds: int, min_sites: int, limit: int, model: Directory,
         ctl: string, train_sh: File, aggregate_py: File}
outputs:
  model: {type: Directory, outputSource: aggregate/model}
  next_round: {type: int, outputSource: aggregate/next_round}
  go: {type: boolean, outputSource: aggregate/go}
steps:
  train_a:
    run: tools/train.cwl
    in: {script: train_sh, limit: limit, site: {default: a}, round: round, model: model, ctl: ctl}
    out: [update]
  train_b:
    run: tools/train.cwl
    in: {script: train_sh, limit: limit, site: {default: b}, round: round, model: model, ctl: ctl}
    out: [update]
  aggregate:
    run: tools/aggregate.cwl
    in: {script: aggregate_py, round: round, max_rounds: max_rounds, min_sites: min_sites,
         model: model, update_a: train_a/update, update_b: train_b/update}
    out: [model, next_round, go]
