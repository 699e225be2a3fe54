"""Every margin, tolerance, limit and machine constant of the planner, with where its
value comes from. Imports nothing; the modules that use a constant import it from here.

"Measured" cites a figure this repository measured (jax/jaxlib 0.10.2 on the 2-core
development CPU); "chosen" marks a design choice that no measurement fixed, and says
what it trades.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------
# graph.py: where the program is cut into stages
# ---------------------------------------------------------------------------------------

# A cut is kept where what crosses it is at most this many times its largest single value
# (one stream, not a stream plus a side branch). Chosen: a transformer's residual stream
# with a layer norm's statistics beside it passes, a stream plus a second activation of
# its size does not.
STREAM_RATIO = 1.25
# A repeated block must hold this share of the program's FLOPs: repeats of a few cheap
# equations (an elementwise run, a loss's reductions) are not blocks. Chosen.
MIN_BLOCK_FLOPS_SHARE = 0.01
# A variant of a repeated block (the same equations in order, up to shapes, with a branch
# added) holds at most this many more equations than the block, as a fraction of the
# block's. Chosen to admit a ResNet block with a projection shortcut, which adds a
# convolution and its normalization: the corpus CNN's block is 53 equations, its
# projection block 78 (+47%); configs/resnet50.yaml's bottleneck 79 and 104 (+32%)
# (tests/test_corpus.py::test_blocks_at_other_widths_found).
VARIANT_EXTRA = 0.5
# A cut inside a block leaves this share of the block's FLOPs on each side: a cut between a
# layer norm's statistics and its scaling is no place to trade anything. Chosen.
MIN_SUB_STAGE_SHARE = 0.1
# A stage with less than this share of the largest stage's FLOPs (index arithmetic, an
# embedding lookup) is merged into its neighbour: it gives the solver nothing to trade
# and only costs profiling time. Chosen.
TRIVIAL_STAGE_SHARE = 0.005
# At most this many stages: each is profiled (one small XLA compile) and the DP is cubic
# in their number. Chosen: gpt2-small unrolled has 12 blocks of 2 stages plus the ends.
MAX_STAGES = 48

# ---------------------------------------------------------------------------------------
# solve.py
# ---------------------------------------------------------------------------------------

# Memory units of the DP: sizes are rounded up to max_bytes / SOLVER_RESOLUTION, so a plan
# that fits in units fits in bytes, at most this fraction of the budget conservative.
# Chosen: 1/16000 of a 12 GB budget is 0.75 MB.
SOLVER_RESOLUTION = 16000

# ---------------------------------------------------------------------------------------
# scan.py and plan.py: layer-stack scans
# ---------------------------------------------------------------------------------------

# A scan is the layer stack when it holds at least this share of the step's forward
# FLOPs. Chosen: the layers of every scanned sample config hold more than 0.8 of them.
SCAN_MIN_SHARE = 0.5
# Sub-stages of a scan body (attention | MLP): per-iteration plans are enumerated over
# them, so their number sets the per-iteration plan count (exponential). Chosen.
MAX_SUB_STAGES = 2
# Mixed per-layer plans in one iteration of the rebuilt scan. Chosen: the scheme count
# grows with it; on scan_lm XLA held 17-18.5 layers' parameters more than the model when
# every layer ran in one iteration (docs/jax-facts.md, fact 4).
MAX_LAYERS_PER_ITERATION = 8

# ---------------------------------------------------------------------------------------
# planner.py: the closed loop
# ---------------------------------------------------------------------------------------

# Whole-step compiles of a fresh `plan()` call: the analysis's calibration compiles (two)
# and at most MAX_VERIFY_COMPILES to verify plans, which the closed loop's rounds and the
# probes share. Issue "Any model a user brings" asks for at most 6; a compile is most of
# the time of a plan() call on a large model (gpt2-small: ~10 s each on 2 CPU cores).
MAX_COMPILES = 6
MAX_VERIFY_COMPILES = MAX_COMPILES - 2
# Slack below which the loop stops spending it: XLA put the plan within this share of the
# budget. Chosen: another round costs a whole compile for at most this much memory.
SLACK_STOP = 0.02
# Model error a probe for a cheaper plan allows for, as a share of the budget, and how
# many probes a call makes at most. Chosen: the calibrated model's error on the returned
# plans of the sample configs is mostly within a few percent (docs/benchmarks.md).
PROBE_MARGIN = 0.03
MAX_PROBES = 4
# How far over the budget the model may put a per-block plan and still have it compiled.
# Measured: the model overstates whole-block checkpoints, whose forward it charges the
# block's whole forward+backward workspace (gpt2-tiny, each block checkpointed with
# dots_saveable: 21.60 MB modelled, 20.28 MB by XLA, +6.5%; with
# dots_with_no_batch_dims_saveable: 20.02 vs 18.84 MB, +6.3%).
PER_BLOCK_MARGIN = 0.1
# The same where no plan fits yet (the model finds none, or XLA put every plan tried over)
# and no per-block plan of the analysis was measured: before calling a budget infeasible,
# the plans a user writes by hand get a compile unless the model puts them far over.
# Measured: the corpus U-Net (tests/corpus.py) puts every block under nothing_saveable
# at 4.04 MB by the model, 3,445,980 B by XLA (+17%); on the other corpus models the
# per-block plans are within PER_BLOCK_MARGIN. Where a plan fits, the narrower margin
# stands: a compile spent on a per-block plan the model puts over is one the probes for a
# cheaper plan lose (the corpus plain-JAX transformer at dots_with_no_batch_dims_saveable's
# peak: 1.66% with it spent, 1.31% without).
PER_BLOCK_FIRST_MARGIN = 0.3
# XLA FLOPs (as a share of the step's) below which two plans count as equally cheap: below
# it, which one XLA counts cheaper is its fusion's doing, not recomputation. Chosen.
REUSE_TOLERANCE = 1e-4

# ---------------------------------------------------------------------------------------
# costmodel.py: the machine
# ---------------------------------------------------------------------------------------

# Measured by costmodel.measure_machine() on the 2-core development CPU (2026-12-03; under
# load from other jobs it gave 2.7e11-4.3e11 FLOP/s and 7.6e9-8.2e9 B/s): balance 37.5
# FLOP/B. scripts/benchmark.py fits the balance to whole training steps instead; on that
# machine the fit is 0 (docs/benchmarks.md), which is why "flops" is the default objective.
DEFAULT_FLOPS_PER_SECOND = 3.0e11
DEFAULT_BYTES_PER_SECOND = 8.0e9

# ---------------------------------------------------------------------------------------
# frontier.py and maxbatch.py: the front ends' sweeps
# ---------------------------------------------------------------------------------------

# Points of a frontier sweep by default. Chosen: enough to show the knee between the
# built-ins' peaks on the sample configs.
MIN_POINTS = 12
# Whole-step compiles of a sweep point between the low end and the no-remat end (but for
# a comparison the planner loses). The sweep's points share one analysis, so a plan XLA
# measured at one budget is reused at every other; a compile is most of a point's time
# (gpt2-tiny: ~1.4 s of ~1.9 s on 2 busy CPU cores, gpt2-small: ~3-4 s). The compile goes
# to the model's plan at the budget less the error XLA measured on the model's last plan:
# planner.plan's first round, the model's plan at the budget itself, was over it on 9 of
# gpt2-tiny's 12 measured plans (by 0.53-0.79 MB, 3-5%), and then served only a larger
# budget. A sweep passing another max_compiles plans each point with planner.plan.
SWEEP_COMPILES = 1
# Where the frontier is flat a compile buys little: when the model's plan for a point
# recomputes less than the cheapest plan XLA already measured within its budget by under
# FLAT_GAIN of the step's FLOPs (both by the model's count: XLA's count of a plan is ~0.2%
# of the step above the model's on gpt2-tiny), the point takes the measured plan and
# compiles nothing. Chosen.
FLAT_GAIN = 0.005
# Whole-step compiles of the low end's retry at XLA's smallest feasible budget. Measured:
# the first two found everything the retry found with six (scanned gpt2-small's 24.57%
# plan at 6.09 GB came from the second round, its 3 probes after it were over the budget;
# gpt2-tiny's 5 compiles were all over).
LOW_END_COMPILES = 2
# The largest batch size `--max-batch` searches up to. Chosen: 2^20 sequences is past any
# budget a device has.
MAX_BATCH = 1 << 20
