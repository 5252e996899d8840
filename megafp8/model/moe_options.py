"""The mixture-of-experts options (Megatron-LM's flag names) and their checks, shared by ModelConfig and the parser."""
from __future__ import annotations

from typing import Any

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
TOKEN_DISPATCHERS = ("alltoall", "allgather")  # Megatron-Core's; its flex (DeepEP) dispatcher is not built


def moe_layer_pattern(num_layers: int, moe_layer_freq: int | str) -> list[bool]:
    """Which layers are MoE: ``--moe-layer-freq N`` makes every N-th one (layer i when i % N == 0, Megatron's rule:
    1 = all), a list ``1,1,0,...`` (one 0/1 per layer; Megatron's ``[1]*3+[0]`` expressions are not evaluated)
    names each."""
    if isinstance(moe_layer_freq, int):
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    values = [v.strip() for v in moe_layer_freq.strip("[]").split(",")]
    if len(values) != num_layers or any(v not in ("0", "1") for v in values):
        raise ValueError(f"--moe-layer-freq {moe_layer_freq!r}: give an integer N (every N-th layer) or one 0/1 per "
                         f"layer, {num_layers} in all, separated by commas")
    return [v == "1" for v in values]


def parse_moe_layer_freq(text: str) -> int | str:
    """The flag's value: an integer, else the 0/1 list as given (checked by moe_layer_pattern)."""
    try:
        return int(text)
    except ValueError:
        return text


def moe_errors(o: Any) -> list[str]:
    """One line per problem of the MoE options on ``o`` (a ModelConfig or the parsed flags), every one at once."""
    errors = []
    if o.num_experts is None:
        given = [f"--{name.replace('_', '-')}" for name, default in MOE_FLAG_DEFAULTS.items()
                 if getattr(o, name, default) != default]
        if given:
            errors.append(f"{', '.join(given)} without --num-experts: the model has no MoE layer")
        return errors
    experts, k = o.num_experts, o.moe_router_topk
    if experts < 2:
        errors.append(f"--num-experts must be at least 2, got {experts}")
    if not 1 <= k <= max(experts, 1):
        errors.append(f"--moe-router-topk ({k}) must be between 1 and --num-experts ({experts})")
    if isinstance(o.moe_layer_freq, int) and o.moe_layer_freq < 1:
        errors.append(f"--moe-layer-freq must be a positive integer or a 0/1 list, got {o.moe_layer_freq}")
    else:
        try:
            moe_layer_pattern(o.num_layers, o.moe_layer_freq)
        except ValueError as e:
            errors.append(str(e))
    for name, choices in (("moe_router_score_function", SCORE_FUNCTIONS),
                          ("moe_router_load_balancing_type", LOAD_BALANCING_TYPES),
                          ("moe_token_drop_policy", TOKEN_DROP_POLICIES),
                          ("moe_token_dispatcher_type", TOKEN_DISPATCHERS)):
        if getattr(o, name) not in choices:
            errors.append(f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, got {getattr(o, name)!r}")
    if o.moe_router_enable_expert_bias and o.moe_router_score_function != "sigmoid":
        errors.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (DeepSeek-V3's "
                      "aux-loss-free balancing adds the bias to sigmoid scores)")
    if o.moe_router_pre_softmax and o.moe_router_score_function != "softmax":
        errors.append("--moe-router-pre-softmax needs --moe-router-score-function softmax")
    factor = o.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        errors.append(f"--moe-expert-capacity-factor must be positive, got {factor}")
    if o.moe_pad_expert_input_to_capacity and factor is None:
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    scaling = o.moe_router_topk_scaling_factor
    if scaling is not None and not scaling > 0:
        errors.append(f"--moe-router-topk-scaling-factor must be positive, got {scaling}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(o, name)
        if value is not None and not value >= 0:
            errors.append(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(o, name)
        if value is not None and value < 1:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {value}")
    return errors


# Every MoE option and its default, Megatron-LM's (aux_loss with coefficient 0 trains without a balancing loss).
MOE_FLAG_DEFAULTS: dict[str, Any] = {
    "moe_layer_freq": 1,
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_shared_expert_intermediate_size": None,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "moe_pad_expert_input_to_capacity": False,
    "moe_token_dispatcher_type": "alltoall",  # Megatron-LM's default is allgather (the same math: see DEFAULTS_THAT_DIFFER)
    "moe_grouped_gemm": False,
}
