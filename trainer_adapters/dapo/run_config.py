"""The DAPO run configuration: one TOML file, every key optional.

```toml
[run]
dir = "runs/dapo-smollm2"     # metrics.csv, curves.png, checkpoints, pushed weights
steps = 30
seed = 0
eval_every = 10               # held-out evaluation every N steps (and at 0 and the end)

[model]
path = "smollm2"              # a Hugging Face checkpoint directory; "smollm2" = the embedded one
device = ""                   # "" = cuda when available, else cpu (bf16 autocast on cuda)

[data]
train = ""                    # JSONL of job lines; "" = the shipped dapo train set; a relative
                              # path that exists beside this file means that file
heldout = ""                  # "" = the shipped held-out set
heldout_limit = 0             # evaluate on the first N held-out tasks (0 = all)

[rollout]                     # what each job asks of the server
temperature = 1.0
max_tokens = 48               # per turn
max_turns = 1
run_timeout_s = 300

[batch]                       # client.batcher.BatcherConfig
groups_per_batch = 4
group_size = 8
max_in_flight_groups = 0
max_rounds = 3
max_staleness = 0

[algo]
lr = 1e-5
warmup_steps = 3
weight_decay = 0.0
grad_clip = 1.0
micro_batch_size = 8
eps_low = 0.2
eps_high = 0.28
dual_clip_c = 3.0             # 0 disables
tis_cap = 2.0                 # upper bound of the importance weights; 0 disables them
is_level = "token"            # importance weights per "token", per "sequence", or "none"
is_mode = "truncate"          # "truncate" (TIS, capped at tis_cap) or "mask" (MIS: 0 outside
is_lower = 0.5                #   [is_lower, tis_cap])
rs_level = "none"             # rejection by ratio bounds: "token", "sequence" or "none"
rs_lower = 0.5
rs_upper = 2.0
bypass = false                # rollout logprobs as the old policy
loss_agg = "token-mean"       # or "rollout-mean": each rollout weighs the same
logit_chunk = 1024            # positions of full-vocabulary logits held at once; 0 = all
gradient_checkpointing = false
overlong_cache = 16           # soft overlong punishment: the last N tokens of an episode's
                              # budget (max_tokens x max_turns) ramp to -1; 0 disables
adv_eps = 1e-6
kl_coef = 0.0

[service]
address = ""                  # "" = start an in-process server (rollout train dapo)
client_id = "dapo-trainer"
weight_sync = "update_weights"  # or "set_version" (weights pushed out of band)
share_weights = true          # in-process server: its engine serves the policy's own tensors
backends = []                 # names to update; [] = all
```
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunSection:
    dir: str = "runs/dapo"
    steps: int = 30
    seed: int = 0
    eval_every: int = 10
    checkpoint_every: int = 0
    """Save a full Hugging Face checkpoint every N steps (0: only at the end)."""
    keep_weights: int = 2
    """Pushed weight directories (``weights/v<N>``) to keep on disk; 0 keeps all."""
    time_limit_s: float = 0.0
    """Stop after the step that crosses this wall-clock budget (0: no limit); the final
    held-out evaluation still runs."""


@dataclass(frozen=True)
class ModelSection:
    path: str = "smollm2"
    device: str = ""


@dataclass(frozen=True)
class DataSection:
    train: str = ""
    heldout: str = ""
    heldout_limit: int = 0
    shuffle: bool = True


@dataclass(frozen=True)
class RolloutSection:
    temperature: float = 1.0
    max_tokens: int = 48
    max_turns: int = 1
    run_timeout_s: float = 300.0
    eval_temperature: float = 0.0
    """Held-out evaluation samples greedily: the same tasks give the same answers unless the
    policy changed, so differences between evaluations are the policy's, not the dice's."""


@dataclass(frozen=True)
class BatchSection:
    groups_per_batch: int = 4
    group_size: int = 8
    max_in_flight_groups: int = 0
    max_rounds: int = 3
    max_staleness: int = 0
    prefetch_groups: int = -1
    """-1: the batcher's default (in-flight groups when max_staleness > 0, else 0)."""
    dynamic_sampling: bool = True
    """Off keeps groups whose rewards are all equal (they train on nothing: zero advantage)."""


@dataclass(frozen=True)
class AlgoSection:
    lr: float = 1e-5
    warmup_steps: int = 3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    mini_batches: int = 1
    """Optimizer steps per batch. 1 is on-policy: the trainer's old logprobs are the current
    ones (detached) and need no extra forward pass; more recompute them first."""
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float = 3.0
    tis_cap: float = 2.0
    is_level: str = "token"
    """Importance weights for the rollout-vs-trainer mismatch: ``token`` (one per token),
    ``sequence`` (one per sequence, the product of its token ratios) or ``none``."""
    is_mode: str = "truncate"
    """``truncate``: weights capped at ``tis_cap`` (TIS). ``mask``: weights outside
    ``[is_lower, tis_cap]`` set to 0 (masked IS)."""
    is_lower: float = 0.5
    rs_level: str = "none"
    """Rejection: ``token`` drops tokens whose ratio pi_train / pi_rollout is outside
    ``[rs_lower, rs_upper]``; ``sequence`` drops whole sequences whose geometric-mean ratio
    is; ``none`` drops nothing."""
    rs_lower: float = 0.5
    rs_upper: float = 2.0
    bypass: bool = False
    """Use the rollout's logprobs as the old policy (the PPO ratio pi_theta / pi_rollout then
    carries the correction; no importance weights)."""
    loss_agg: str = "token-mean"
    """``token-mean``: every loss token of a mini-batch weighs the same (DAPO's choice: a long
    answer's tokens are not diluted). ``rollout-mean``: every rollout weighs the same whatever
    its number of segments or tokens (for harness trajectories whose segment counts vary: a
    rollout split into five segments must not get five times the say)."""
    overlong_cache: int = 16
    logit_chunk: int = 1024
    """Positions whose full-vocabulary logits exist at once when computing log-probabilities
    and entropy (forward and backward); 0 materialises the micro-batch's logits whole."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (less
    memory for long episodes, about a third more compute)."""
    adv_eps: float = 1e-6
    kl_coef: float = 0.0
    """Reserved: DAPO drops the KL term; a non-zero value is rejected (no reference model)."""


@dataclass(frozen=True)
class ServiceSection:
    address: str = ""
    token: str = ""
    client_id: str = "dapo-trainer"
    weight_sync: str = "update_weights"
    share_weights: bool = True
    """In-process server only: its engine serves the policy's own tensors (one copy of the
    model, no checkpoint per step; generation pauses during the update). False: a separate
    copy in the engine, updated from a checkpoint each step as with a remote server."""
    backends: tuple[str, ...] = ()
    server_set: tuple[str, ...] = ()
    """In-process server only: extra ``KEY=VALUE`` settings (as ``rollout serve --set``)."""


@dataclass(frozen=True)
class DapoConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    batch: BatchSection = field(default_factory=BatchSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    service: ServiceSection = field(default_factory=ServiceSection)

    def validate(self) -> None:
        if self.algo.kl_coef != 0:
            raise ValueError("algo.kl_coef: DAPO trains without a KL term and this trainer "
                             "keeps no reference model; set it to 0")
        if self.service.weight_sync not in ("update_weights", "set_version"):
            raise ValueError("service.weight_sync must be 'update_weights' or 'set_version', "
                             f"got {self.service.weight_sync!r}")
        for name, value in (("run.steps", self.run.steps), ("algo.micro_batch_size",
                            self.algo.micro_batch_size), ("algo.mini_batches",
                            self.algo.mini_batches), ("rollout.max_tokens",
                            self.rollout.max_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        from rollout.trainer_adapters.dapo.loss import LOSS_AGG_MODES

        if self.algo.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"algo.loss_agg must be one of {LOSS_AGG_MODES}, got "
                             f"{self.algo.loss_agg!r}")
        self.correction()  # raises naming the bad key
        budget = self.rollout.max_tokens * max(self.rollout.max_turns, 1)
        if self.algo.overlong_cache >= budget:
            raise ValueError(f"algo.overlong_cache ({self.algo.overlong_cache}) must be smaller "
                             f"than an episode's budget, rollout.max_tokens x max_turns "
                             f"({budget})")


    def correction(self) -> Any:
        """The mismatch correction the ``[algo]`` keys select."""
        from rollout.trainer_adapters.dapo.correction import CorrectionConfig

        a = self.algo
        level = a.is_level if a.tis_cap else "none"
        try:
            return CorrectionConfig(is_level=level, is_mode=a.is_mode, is_lower=a.is_lower,
                                    is_upper=a.tis_cap or 1.0, rs_level=a.rs_level,
                                    rs_lower=a.rs_lower, rs_upper=a.rs_upper, bypass=a.bypass)
        except ValueError as exc:
            raise ValueError(f"[algo] mismatch correction: {exc}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None
                ) -> DapoConfig:
    """Read a TOML file (unknown sections or keys are errors that name them), then apply
    ``overrides`` given as ``{"section.key": value}``."""
    raw: dict[str, Any] = tomllib.loads(Path(path).read_text()) if path else {}
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        raw.setdefault(section, {})[key] = value
    cfg = DapoConfig()
    known = {f.name: f for f in fields(DapoConfig)}
    updates: dict[str, Any] = {}
    for section, values in raw.items():
        if section not in known:
            raise ValueError(f"unknown config section [{section}]; known: {', '.join(known)}")
        if not isinstance(values, dict):
            raise ValueError(f"[{section}] must be a table")
        current = getattr(cfg, section)
        assert is_dataclass(current)
        names = {f.name: f for f in fields(current)}
        unknown = set(values) - set(names)
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)} in [{section}]; known: "
                             f"{', '.join(names)}")
        coerced = {k: _coerce(getattr(current, k), v, f"{section}.{k}") for k, v in values.items()}
        updates[section] = replace(current, **coerced)  # type: ignore[type-var]
    cfg = replace(cfg, **updates)
    if path:
        cfg = replace(cfg, data=_beside(cfg.data, Path(path).resolve().parent))
    cfg.validate()
    return cfg


def _beside(data: DataSection, config_dir: Path) -> DataSection:
    """Relative data paths that exist next to the config file mean those files, so a shipped
    config names its shipped data wherever it is run from; others stay relative to the
    working directory."""
    def beside(value: str) -> str:
        if value and not Path(value).is_absolute() and (config_dir / value).is_file():
            return str(config_dir / value)
        return value

    return replace(data, train=beside(data.train), heldout=beside(data.heldout))


def _coerce(default: Any, value: Any, name: str) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return tuple(value)
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(default):
        raise ValueError(f"{name} must be a {type(default).__name__}, got {value!r}")
    return value
