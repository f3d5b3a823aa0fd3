"""Optimizer state in checkpoints: a layout-independent format, and loading it exactly.

Format: megatron's distributed optimizer saves its state in `fully_reshardable` form, i.e. per model
parameter (`optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>`), sharded like the
parameter itself, so a checkpoint saved at any TP x PP x DP loads at any other. (Its
`dp_reshardable` form follows the optimizer's internal DP buckets and reshards over DP only.)
Mixture-of-experts models at EP > 1 get a chained optimizer (dense and expert parameters over their
own DP groups), a single one at EP1: the keys carry no `chained_<i>.` prefix, so the per-parameter
state loads across EP sizes. What else each optimizer saves (its param groups' hyper-parameters and
the step count) follows that structure; where the structure changed, each optimizer keeps its own
hyper-parameters (the run's config; the scheduler restores the learning rate) and takes the step count.

Loading: megatron-core 0.16.1's distributed optimizer without Apex/Transformer Engine (torch's Adam,
which keeps a `step` tensor per parameter) has two defects that we correct here, where we load:
- it gives every parameter's state the *same* `step` tensor; torch's Adam increments each
  parameter's `step` in place, so the shared counter advances once per parameter per optimizer step
  and bias correction is wrong from the first step after a resume;
- its per-parameter loaders copy every key of the live state, `step` included, from the loaded
  tensors, which hold no `step`: the load fails with KeyError 'step'.
With Transformer Engine or Apex (FusedAdam keeps one step per param group) neither applies and the
code below leaves the state as megatron loaded it.

Saving and loading, in any dtype but fp32: the distributed optimizer finds a parameter's main copy and
Adam state through `model_param_group_index_map` (group, position), positions counted in the model's
parameter order, but it orders each optimizer group's main parameters fp32 ones first, then the fp32
copies of the bf16/fp16 ones. A bf16 model with some fp32 parameters (the RMSNorm weights of megatron's
torch-norm fallback, used by the local layer spec on CPU and GPU) then saves, and loads, one parameter's
state as another's: a shape error at the first save, or silently swapped state where the shapes agree.
Before each save and load, `repair_param_positions` recounts the positions in the order the groups hold them.
"""

from __future__ import annotations

import torch

OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _chained(optimizer) -> list:
    """The megatron optimizers inside `optimizer` (a ChainedOptimizer or a single one)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def repair_param_positions(optimizer) -> None:
    """Point each model parameter of a distributed optimizer at its own main parameter and Adam state
    (see the module docstring); a no-op where a group holds parameters of one dtype."""
    for part in _chained(optimizer):
        if not hasattr(part, "model_param_group_index_map"):  # not a distributed optimizer
            continue
        for index, (fp32, low_precision) in enumerate(zip(part.model_fp32_groups, part.model_float16_groups)):
            for position, model_param in enumerate([*fp32, *low_precision]):
                part.model_param_group_index_map[model_param] = (index, position)


def sharded_optimizer_state(optimizer, model_sharded_state: dict, is_loading: bool) -> dict:
    repair_param_positions(optimizer)
    return optimizer.sharded_state_dict(model_sharded_state, is_loading=is_loading, metadata=OPTIMIZER_FORMAT)


def initialize_optimizer_state(optimizer) -> None:
    """Create (zero) Adam state before loading into it: the optimizer only creates state at its first
    step, and without Apex/TE megatron's distributed optimizer also needs each state's `step`."""
    for part in _chained(optimizer):
        if part.init_state_fn is not None:
            part.init_state_fn(part.optimizer, part.config)
        for state in part.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _common_state(part, state: dict, loaded: dict) -> dict:
    """`part`'s saved hyper-parameters and step count, or, where the checkpoint's optimizers were
    chained differently (saved at another EP size), its own with the saved step count."""
    if "optimizer" in state:
        return state
    saved = [s for s in (loaded, *loaded.values()) if isinstance(s, dict) and "optimizer" in s]
    steps = {group["step"] for s in saved for group in s["optimizer"]["param_groups"]}
    assert len(steps) == 1, steps  # megatron synchronises the steps of chained optimizers before saving
    own = dict(part.state_dict(), param_state_sharding_type=saved[0]["param_state_sharding_type"])
    for group in own["optimizer"]["param_groups"]:
        group["step"] = next(iter(steps))
    return own


def load_optimizer_state(optimizer, loaded: dict) -> None:
    """Load what `dist_checkpointing.load` returned for `sharded_optimizer_state(..., is_loading=True)`:
    a dict per optimizer of a chain (by index), merged with the state the checkpoint saved unsharded."""
    parts = _chained(optimizer)
    states = [loaded] if len(parts) == 1 else [loaded[index] for index in range(len(parts))]
    for part, state in zip(parts, states):
        if "param_state" not in state:  # not a distributed optimizer: megatron's own load is exact
            part.load_state_dict(state)
            continue
        param_state = state.pop("param_state")
        state = _common_state(part, state, loaded)
        part.load_state_dict(state)  # hyper-parameters and the step count (one tensor for all parameters)
        inner = part.optimizer.state
        steps = {param: inner[param].pop("step") for param in list(inner) if "step" in inner[param]}
        assert state["param_state_sharding_type"] == OPTIMIZER_FORMAT["distrib_optim_sharding_type"], state
        part.load_parameter_state_from_fully_reshardable(param_state)
        for param, step in steps.items():
            inner[param]["step"] = step.clone()  # one counter per parameter, as torch's Adam expects


def _step_tensors(part) -> list[torch.Tensor]:
    return [state["step"] for state in part.optimizer.state.values() if "step" in state]


def check_step_counts(optimizer, taken: int, where: str) -> None:
    """Every parameter counts its own Adam steps (per parameter with torch's Adam, per param group
    with Apex/TE FusedAdam), and the count equals the optimizer steps `taken` (the LR scheduler's
    count). fp16 loss scaling skips the steps whose gradients overflowed, so there it may be lower."""
    counts, may_skip = set(), False
    for part in _chained(optimizer):
        tensors = _step_tensors(part)
        assert len({id(t) for t in tensors}) == len(tensors), f"{where}: parameters share one Adam step counter"
        counts.update(float(t) for t in tensors)
        if not tensors:
            counts.update(float(g["step"]) for g in part.optimizer.param_groups if g["params"] and "step" in g)
        may_skip |= part.config.fp16
    exact = counts <= {taken} or (may_skip and len(counts) == 1 and max(counts) <= taken)
    assert exact, f"{where}: the optimizer counts {sorted(counts)} steps; {taken} were taken"
