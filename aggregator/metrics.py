"""The names of the metrics a site reports in its update's manifest: one place for all.

The trainer (:mod:`xffl.training.trainer`) writes them, admission checks them
(:mod:`xffl.aggregator.reported`), the aggregators average them, and the run's records,
status, report and trackers read them: every one of them names a metric through these
constants, never through a string of its own.
"""

from __future__ import annotations

# what a site's training reports about its round
LOSS = "loss"  # mean training loss over the round's steps
LOSS_FIRST = "loss_first"
LOSS_LAST = "loss_last"
TOKENS_PER_S = "tokens_per_s"
TRAIN_SECONDS = "train_seconds"
STEPS = "steps"  # optimizer steps done (a float, as every metric)
LR_LAST = "lr_last"
STARTUP_SECONDS = "startup_seconds"  # from the launcher's start to the first step
TRAINING_METRICS = (LOSS, LOSS_FIRST, LOSS_LAST, TOKENS_PER_S, TRAIN_SECONDS, STEPS, LR_LAST,
                    STARTUP_SECONDS)

# what a site measures on its held-out data: the incoming global's loss, its update's, the
# sequences behind them and their targets in the loss (the site's weight in the federated
# validation loss); numbers about the site's round, not properties of an aggregate
VAL_LOSS = "val_loss"
VAL_LOSS_UPDATE = "val_loss_update"
VAL_SAMPLES = "val_samples"
VAL_TOKENS = "val_tokens"
EVAL_SECONDS = "eval_seconds"
VALIDATION_LOSSES = (VAL_LOSS, VAL_LOSS_UPDATE)  # cross-entropies: never negative
VALIDATION_METRICS = (*VALIDATION_LOSSES, VAL_SAMPLES, VAL_TOKENS)  # all of them or none
# the coordinator's, never a site's: the median across the admitted sites' val_loss, beside
# the federated (token-weighted) mean in rounds/<r>/validation.json; training.stop_when reads
# it, and status names it so
VAL_LOSS_MEDIAN = "val_loss_median"
VAL_LOSS_ROBUST = "the median across sites"

# how the site's hardware ran the round (xffl.training.telemetry): per site, never averaged;
# the device's name and count are words, so they travel in the manifest's ``extra``
TOKENS_PER_S_PER_GPU = "tokens_per_s_per_gpu"  # steady state: warm-up steps left out
TFLOPS = "tflops"  # achieved model TFLOP/s per device (torchtitan's FLOP count)
MFU = "mfu"  # TFLOPS over the device's dense bf16 peak (absent when no peak is known)
PEAK_MEMORY_GIB = "peak_memory_gib"  # the largest peak of any rank (GPU memory, else RSS)
SAVE_SECONDS = "save_seconds"  # writing the update, checksums included
HARDWARE_METRICS = (TOKENS_PER_S_PER_GPU, TFLOPS, MFU, PEAK_MEMORY_GIB, SAVE_SECONDS)
# training.local_groups (xffl.training.local_groups): the groups' syncs inside the site, and
# the bytes a rank all-reduces for them per sync, per optimizer step and in the round
GROUP_SYNCS = "group_syncs"
GROUP_SYNC_BYTES = "group_sync_bytes"
GROUP_BYTES_PER_STEP = "group_bytes_per_step"
GROUP_BYTES_ROUND = "group_bytes_round"
GROUP_METRICS = (GROUP_SYNCS, GROUP_SYNC_BYTES, GROUP_BYTES_PER_STEP, GROUP_BYTES_ROUND)
SITE_ONLY_METRICS = (*VALIDATION_METRICS, EVAL_SECONDS, *HARDWARE_METRICS,
                     *GROUP_METRICS)  # never averaged

# the only metric names an update may carry: a site cannot fill the global's manifest with
# names of its own (the global carries the mean of each, and every site's numbers)
KNOWN_METRICS = frozenset((*TRAINING_METRICS, *SITE_ONLY_METRICS))
