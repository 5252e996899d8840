"""GPTModel: a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) built from tensor-parallel layers.

Data flow (activations ``[seq, batch, hidden]`` as in Megatron, so sequence-parallel splits are
contiguous dim-0 chunks; under SP, "s" between TP regions is ``s/TP``)::

    input_ids [b, s] -> transpose -> embedding (vocab-parallel)      [s, b, h]
      -> num_layers x TransformerLayer:
           x = x + dropout(linear_proj(attention(linear_qkv(input_layernorm(x)))))
           x = x + dropout(linear_fc2(swiglu(linear_fc1(pre_mlp_layernorm(x)))))
         (--no-pre-norm drops input_layernorm / pre_mlp_layernorm; --post-norm wraps each sublayer's output in
         attention_output_layernorm / mlp_output_layernorm before the dropout and the add; --residual-tau makes
         each add sqrt(1 - tau) x + sqrt(tau) out; --unit-scaling multiplies every linear's output by
         1/sqrt(fan_in), its weights drawn N(0, 1))
      -> final_layernorm -> output_layer (column-parallel)           [s, b, V/TP]
      -> labels given: vocab-parallel CE -> per-token loss          [b, s]
         else: logits transposed to                                 [b, s, V/TP]

Parameter names (``layers.{i}.self_attention.linear_qkv.weight``, ...) follow Megatron-Core; their
HF Llama counterparts and the fused layouts are in ``megafp8.model.hf_mapping``. Dropout (--hidden-dropout above,
--attention-dropout on the attention probabilities) runs in training mode only (megafp8.model.dropout).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import nn

from megafp8.fp8 import CONFIG, Fp8Recipe, PrecisionPlan, apply_precision_map, layer_recipes
from megafp8.fp8.prologue import RMSNormPrologue
from megafp8.model.attention import SelfAttention
from megafp8.model.config import ModelConfig
from megafp8.model.dropout import hidden_dropout_add
from megafp8.model.mlp import MLP
from megafp8.model.moe import MoELayer
from megafp8.model.norm import RMSNorm
from megafp8.model.recompute import recompute, recomputed_layer_groups
from megafp8.model.rotary import RotaryEmbedding
from megafp8.parallel.context_parallel import local_positions
from megafp8.parallel.cross_entropy import vocab_parallel_cross_entropy
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.random import ModelParallelRNG, initialize_parameters, model_parallel_rng
from megafp8.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, \
    init_method_normal


class TransformerLayer(nn.Module):
    """Pre-norm decoder block; residual adds happen on the (sequence-sharded under SP) layer input."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, layer_number: int = 0) -> None:
        super().__init__()
        sp = parallel_state.sequence_parallel

        def norm(initial_gain: float = 1.0) -> RMSNorm:
            return RMSNorm(config.hidden_size, config.norm_eps, sp, config.params_dtype,
                           zero_centered_gamma=config.layernorm_zero_centered_gamma, initial_gain=initial_gain)

        self.input_layernorm = norm() if config.pre_norm else None
        self.self_attention = SelfAttention(config, parallel_state)
        self.pre_mlp_layernorm = norm() if config.pre_norm else None
        # --num-experts: a mixture of experts in the layers --moe-layer-freq names (megafp8.model.moe)
        self.is_moe = config.is_moe_layer(layer_number)
        self.mlp = MoELayer(config, parallel_state) if self.is_moe else MLP(config, parallel_state)
        # --post-norm: each sublayer's output normalized before the residual add (FOG), starting small
        self.attention_output_layernorm = self.mlp_output_layernorm = None
        if config.post_norm:  # FOG's gains start at 1/sqrt(L); under --residual-tau the residual weights do that
            gain = 1.0 if config.residual_tau is not None else 1 / math.sqrt(config.num_layers)
            self.attention_output_layernorm = norm(gain)
            self.mlp_output_layernorm = norm(gain)
        # --residual-tau: sqrt(1 - tau) x + sqrt(tau) F(x) (μnit Scaling's variance-preserving residual)
        tau = config.residual_tau
        self.residual_weights = None if tau is None else (math.sqrt(1 - tau), math.sqrt(tau))
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel, self.tp_size = sp, parallel_state.tp_size
        # RMSNorm -> QKV / FC1 and SwiGLU -> FC2 run as the linears' prologues (megafp8.fp8.prologue): in FP8 fused
        # into the input cast, bit-identical to the unfused modules; False runs the norms and SwiGLU on their own.
        self.fuse_fp8_prologues = True

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                rng: ModelParallelRNG | None = None) -> torch.Tensor:
        """`rng`: the model-parallel RNG of the dropout masks that differ per TP rank (megafp8.model.dropout)."""
        if self.fuse_fp8_prologues:
            # The norms are still called (as_prologue): their forward hooks, e.g. the overlapped param gather, run.
            out = self.self_attention(x, rotary, input_norm=_prologue(self.input_layernorm, x), rng=rng)
            x = self._dropout_add(out, x, rng, self.attention_output_layernorm)
            if self.is_moe:  # the router reads the normed tokens: no prologue to fuse into
                return self._dropout_add(self.mlp(_normed(self.pre_mlp_layernorm, x)), x, rng, self.mlp_output_layernorm)
            return self._dropout_add(self.mlp(x, input_norm=_prologue(self.pre_mlp_layernorm, x), fuse_activation=True),
                                     x, rng, self.mlp_output_layernorm)
        x = self._dropout_add(self.self_attention(_normed(self.input_layernorm, x), rotary, rng=rng), x, rng,
                              self.attention_output_layernorm)
        return self._dropout_add(self.mlp(_normed(self.pre_mlp_layernorm, x)), x, rng, self.mlp_output_layernorm)

    def _dropout_add(self, out: torch.Tensor, residual: torch.Tensor, rng: ModelParallelRNG | None,
                     output_norm: RMSNorm | None) -> torch.Tensor:
        """residual + dropout(out), with --post-norm residual + dropout(RMSNorm(out)), with --residual-tau
        sqrt(1 - tau) residual + sqrt(tau) dropout(...)."""
        out = _normed(output_norm, out)
        if self.residual_weights is not None:
            keep, add = self.residual_weights
            residual, out = residual * keep, out * add
        return hidden_dropout_add(out, residual, self.hidden_dropout, self.training, rng, self.sequence_parallel,
                                  self.tp_size)


def _prologue(norm: RMSNorm | None, x: torch.Tensor) -> RMSNormPrologue | None:
    """The pre-norm as the next linear's fused prologue (None under --no-pre-norm: the linear reads x itself)."""
    return norm(x, as_prologue=True) if norm is not None else None


def _normed(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return norm(x) if norm is not None else x


class GPTModel(nn.Module):
    """The decoder, or the slice of it one pipeline stage holds.

    ``pre_process`` (first stage) owns the embedding, ``post_process`` (last stage) the final norm,
    output head and loss; ``layer_numbers`` are the global indices of the layers this stage holds
    (default: all), kept as the parameter-name index so checkpoints are layout-independent.
    The layout is validated against the config before any parameter is allocated.

    ``fp8_recipe`` runs every transformer block's linears in FP8 except the first and last
    ``first_last_layers_bf16`` blocks (--first-last-layers-bf16); embedding, norms, attention
    softmax, output head and loss always stay in high precision. Without a recipe the blocks follow
    megafp8.fp8.fp8_autocast (high precision outside it).
    """

    def __init__(self, config: ModelConfig, parallel_state: ParallelState, *, pre_process: bool = True,
                 post_process: bool = True, layer_numbers: Sequence[int] | None = None,
                 fp8_recipe: Fp8Recipe | None = None, first_last_layers_bf16: int = 0,
                 rng: ModelParallelRNG | None = None) -> None:
        super().__init__()
        parallel_state.validate_model(config)
        self.config = config
        self.parallel_state = parallel_state
        self.tp = parallel_state.tp_group
        self.pre_process = pre_process
        self.post_process = post_process
        self.padded_vocab_size = config.padded_vocab_size(parallel_state.tp_size)
        self.share_embeddings_and_output_weights = config.tie_embeddings and pre_process and post_process
        std = config.init_method_std

        if pre_process:
            self.embedding = VocabParallelEmbedding(self.padded_vocab_size, config.hidden_size, parallel_state,
                                                    init_method=init_method_normal(std),
                                                    params_dtype=config.params_dtype, perform_initialization=False)
        # Tables for --seq-length, grown on a longer forward (not 131072 positions for a Llama-3.1 config).
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                      scaling=config.rope_scaling, positions=config.seq_length)
        layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, parallel_state, i) for i in layer_numbers})
        if post_process:
            self.final_layernorm = RMSNorm(config.hidden_size, config.norm_eps, parallel_state.sequence_parallel,
                                           config.params_dtype, zero_centered_gamma=config.layernorm_zero_centered_gamma)
            # With tied embeddings on one stage the head reuses embedding.weight (same [V/TP, h] shard);
            # across pipeline stages the last stage keeps its own copy, tagged for the embedding-group sync.
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, parallel_state, init_method=init_method_normal(std),
                skip_weight_param_allocation=self.share_embeddings_and_output_weights, padded_vocab=True,
                params_dtype=config.params_dtype, perform_initialization=False)
            if config.tie_embeddings and not pre_process:
                self.output_layer.weight.shared_embedding = True
        if config.unit_scaling:  # μnit Scaling: unit-variance weights, each linear's output times 1/sqrt(fan_in)
            for m in self.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    m.output_multiplier = 1 / math.sqrt(m.input_size)
        # The model owns its plan: every later precision change (the guard, a schedule) goes through it.
        self.precision_plan = PrecisionPlan(self)
        if post_process:
            self.precision_plan.set_recipe("output_layer", None, CONFIG)  # the logits GEMM stays high precision
        if fp8_recipe is not None:
            recipes = layer_recipes(config.num_layers, fp8_recipe, first_last_layers_bf16)
            apply_precision_map(list(self.layers.values()), [recipes[int(i)] for i in self.layers])
            if config.fp8_dot_product_attention:  # the attention's own delayed-scaling states
                for i, layer in self.layers.items():
                    recipe = recipes[int(i)]
                    if recipe is not None and recipe.is_delayed:
                        layer.self_attention.add_fp8_scaling(recipe)
        # Layout-invariant init: each parameter from the generator of (seed, global name), full tensor then
        # this rank's shard. The last stage's copy of a tied embedding is drawn as embedding.weight, so
        # both stages start identical without communication.
        # The dropout masks that differ per TP rank come from this tracker's stream, and recomputed layers replay
        # its saved states. With dropout and none given, the model builds its own from (seed, TP rank, PP rank),
        # Megatron's offsets; the pipeline stages of one rank (virtual pipeline) must share one: pass it as rng.
        if rng is None and (config.attention_dropout or config.hidden_dropout):
            rng = model_parallel_rng(config.seed, self.tp.rank, parallel_state.coords.pp)
        self.rng: ModelParallelRNG | None = rng
        aliases = {"output_layer.weight": "embedding.weight"} if config.tie_embeddings and not pre_process else {}
        initialize_parameters(self, config.seed, self.tp.rank, self.tp.size, vocab_size=config.vocab_size,
                              aliases=aliases, group_coords=parallel_state.group_coordinates())

    def _run_layers(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        layers = list(self.layers.values())
        cfg = self.config
        if cfg.recompute_granularity != "full" or not torch.is_grad_enabled():
            return _layers_forward(layers, x, *rotary, rng=self.rng)
        for start, end, recomputed in recomputed_layer_groups(len(layers), cfg.recompute_method,
                                                              cfg.recompute_num_layers):
            run = functools.partial(_layers_forward, layers[start:end], rng=self.rng)
            x = recompute(run, x, *rotary, rng=self.rng) if recomputed else run(x, *rotary)
        return x

    def _rotary_tables(self, local_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this rank's tokens: positions 0.. of the sequence, or under context parallelism the
        global positions of its two load-balanced chunks (RoPE must see where a token sits in the sequence)."""
        ps = self.parallel_state
        seq_len = local_rows * (self.tp.size if ps.sequence_parallel else 1)
        if ps.cp_size == 1:
            return self.rotary(seq_len)
        full = seq_len * ps.cp_size
        return self.rotary(full, local_positions(full, ps.cp_rank, ps.cp_size, device=self.rotary.cos.device))

    def forward(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` / ``labels``: ``[b, s]``; ``hidden_states``: the previous stage's output when not
        ``pre_process``. Returns the per-token loss ``[b, s]`` (fp32) when ``labels`` is given, else the
        local logits shard ``[b, s, V/TP]`` (padded vocab), or the hidden states when not ``post_process``."""
        if self.pre_process:
            x = self.embedding(input_ids.t().contiguous())  # [s(/TP), b, h]
            if self.config.embedding_scale != 1.0:  # --embedding-scale
                x = x * self.config.embedding_scale
        elif hidden_states is None:
            raise ValueError("GPTModel without pre_process needs hidden_states from the previous stage")
        else:
            x = hidden_states
        x = self._run_layers(x, self._rotary_tables(x.shape[0]))
        if not self.post_process:
            return x

        x = self.final_layernorm(x)
        output_weight = self.embedding.weight if self.share_embeddings_and_output_weights else None
        logits = self.output_layer(x, weight=output_weight)  # [s, b, V/TP]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp, vocab_size=self.config.vocab_size)
        return loss.t().contiguous()


def _layers_forward(layers: Sequence[TransformerLayer], x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, rng: ModelParallelRNG | None = None) -> torch.Tensor:
    for layer in layers:
        x = layer(x, (cos, sin), rng=rng)
    return x
