"""The names a run's metrics and saved state go under: defined once, for the integrations that
write them and for the run report and figures that read them back."""

from __future__ import annotations

PREFIX = "tapesac/"  # every TapeSAC metric's name starts with it

# The per-step scalars.
STEP_TIME_MS = "tapesac/step_time_ms"
MEMORY_LIMIT_BYTES = "tapesac/memory_limit_bytes"
SAVED_BYTES = "tapesac/saved_bytes"
REPLAYED_NODES = "tapesac/replayed_nodes"
PEAK_MEMORY_BYTES = "tapesac/peak_memory_bytes"
PREDICTED_SPEEDUP = "tapesac/predicted_speedup"
MEASURED_SPEEDUP = "tapesac/measured_speedup"
MEASURED_SPEEDUP_VS_FULL = "tapesac/measured_speedup_vs_full"
PREDICTED_PEAK_BYTES = "tapesac/predicted_peak_bytes"
PLAIN_BLOCKS = "tapesac/plain_blocks"
TORCH_CHECKPOINT_BLOCKS = "tapesac/torch_checkpoint_blocks"
STEADY_BLOCKS = "tapesac/steady_blocks"
OFFLOADED_BYTES = "tapesac/offloaded_bytes"
COPY_TIME = "tapesac/copy_time"  # ms the plan's copies add after overlap, as modelled

SCALARS = (
    STEP_TIME_MS,
    MEMORY_LIMIT_BYTES,
    SAVED_BYTES,
    REPLAYED_NODES,
    PEAK_MEMORY_BYTES,
    PREDICTED_SPEEDUP,
    MEASURED_SPEEDUP,
    MEASURED_SPEEDUP_VS_FULL,
    PREDICTED_PEAK_BYTES,
    PLAIN_BLOCKS,
    TORCH_CHECKPOINT_BLOCKS,
    STEADY_BLOCKS,
    OFFLOADED_BYTES,
    COPY_TIME,
)

# Logged when a plan is solved, where the tracker takes text and images (TensorBoard).
PLAN_TEXT = "tapesac/plan"  # its explain() table, for people
PLAN_JSON = "tapesac/plan_json"  # the plan as data (report.LoggedPlan), for the run report
PLAN_JSON_EVENTS = PLAN_JSON + "/text_summary"  # the tag TensorBoard's add_text stores it under
FRONTIER_IMAGE = "tapesac/frontier"

# The controller's state_dict in the integrations' checkpoints: the Lightning callback's state
# key, and the HF Trainer's entry in TrainerState.stateful_callbacks (so in each checkpoint's
# trainer_state.json; not a callback's class name, so Trainer never tries to rebuild it).
STATE_KEY = "TapeSAC"
