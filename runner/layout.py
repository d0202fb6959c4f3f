"""What a run folder holds, each name defined once (the engine names ``checkpoints/`` and a checkpoint's own files).

<run>/run.log              every rank's log lines (rank 0's, and any rank's warnings)
<run>/logs/                TensorBoard events
<run>/metrics.json         the final metrics and step
<run>/model/               the final weights (model.safetensors; Hugging Face's config.json for its models)
<run>/.hydra/              Hydra's record of the composed config and the overrides typed
<run>/checkpoints/checkpoint_N/config.yaml, overrides.yaml   the run's config and overrides, in every checkpoint
"""

LOG_FILE = "run.log"
LOGS_DIR = "logs"
METRICS_FILE = "metrics.json"
MODEL_DIR = "model"
HYDRA_DIR = ".hydra"
HYDRA_OVERRIDES_FILE = "overrides.yaml"  # in HYDRA_DIR: the overrides as typed
CONFIG_FILE = "config.yaml"  # in each checkpoint: the resolved config a resume starts from
OVERRIDES_FILE = "overrides.yaml"  # in each checkpoint: the overrides a resume replays
