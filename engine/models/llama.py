"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma, Phi-3, and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE) over a flattened token batch.

Input is [num_tokens] ids and positions for a mixed batch of prefill chunks and
decodes; attention goes through an AttentionBackend with explicit metadata.
q/k/v and gate/up projections are fused (the loader concatenates HF's weights).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from compiler.kernels import cpu_fused, cpu_gemv
from compiler.kernels.cpu_linear import MIN_ONEDNN_ROWS, linear, pack_for_gemm, row_bucket, warm_buckets
from engine.distributed.parallel import TensorParallel
from engine.distributed.parallel_layers import ParallelLMHead, VocabParallelEmbedding, parallel_logits
from engine.layers.attention.base import AttentionBackend, AttentionMetadata
from engine.layers.attention.layer import Attention
from engine.layers.forward_context import ForwardContext
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import WEIGHT_COPIES, Linear, exact_half
from engine.layers.mlp import MLP
from engine.layers.quant.gguf_embedding import BlockEmbedding
from engine.layers.rotary import RotaryEmbedding
from engine.layers.sparse_moe import SparseMoE
from engine.models import cpu_stack
from engine.models.config import ModelConfig
from engine.models.sharding import check_shardable, vocab_rows_per_rank


def fuse_cpu_ops(model: nn.Module, cache_dir: Path | None) -> bool:
    """Run `model`'s norms, rotary embeddings and MLP activations through compiler/kernels/cpu_fused.py's
    ops (loaded, on the first start built, now). False: the library is not there (cpu_fused logs
    why) and the eager ops stay."""
    if not cpu_fused.FUSED.ensure(cache_dir):
        return False
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, MLP)):
            module.fused = True
    return True


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.self_attn = Attention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.mlp = SparseMoE(config, tp) if layer_index in config.sparse_layers else MLP(config, tp=tp)
        # Gemma 2: post_attention_layernorm normalises the attention output; the MLP has a norm on
        # each side. Otherwise post_attention_layernorm is the norm before the MLP.
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
            self.post_feedforward_layernorm = RMSNorm(
                config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
            )

    def forward(self, residual, delta, rope, kv_cache, meta, backend, lora=None):
        """The residual stream is carried as (residual, delta not yet added): each add is done by the
        norm that reads its sum (one fused op on the CPU). Returns the next (residual, delta)."""
        residual, h = self.input_layernorm.add_forward(residual, delta)
        attn = self.self_attn(h, rope, kv_cache, meta, backend, lora)
        if self.sandwich:
            residual = residual + self.post_attention_layernorm(attn)
            h = self.pre_feedforward_layernorm(residual)
            return residual, self.post_feedforward_layernorm(self.mlp(h, lora))
        residual, h = self.post_attention_layernorm.add_forward(residual, attn)
        return residual, self.mlp(h, lora)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallel | None = None) -> None:
        """tp: this rank's place in a tensor-parallel group (engine/distributed/parallel.py): the
        model is then this rank's shard; None (or one rank): the whole model."""
        super().__init__()
        self.config = config
        tp = self.tp = tp if tp is not None and tp.world_size > 1 else None
        check_shardable(config, tp)
        # No random init (the weights are loaded): on the meta device it would import Dynamo, seconds of start-up.
        self.embed_tokens = (
            nn.Embedding(
                config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
            )
            if tp is None
            else VocabParallelEmbedding(vocab_rows_per_rank(config, tp), config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.rotary = RotaryEmbedding(config, max_positions)
        # Gemma 3: windowed layers rotate with their own base (and no scaling).
        self.rotary_local = (
            None
            if config.local_rope_theta is None
            else RotaryEmbedding(
                dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None), max_positions
            )
        )
        # (a bare model has no head: compute_logits then reads the embeddings, only ever for warm-ups)
        self.lm_head = (
            None
            if config.tie_word_embeddings or not config.generates
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if tp is None
            else ParallelLMHead(vocab_rows_per_rank(config, tp), config.hidden_size, tp)
        )
        # GGUF on the CPU: the LM head also in the file's blocks, for steps of fewer than
        # packed_head_rows rows (engine/models/loader/gguf_quant.py: pack_head)
        self.packed_head: Linear | None = None
        # An fp16/bf16 checkpoint in float32 on the CPU: the LM head's exact 2-byte copy, for steps
        # of decode rows (process_weights_after_loading "half")
        self.half_head: torch.Tensor | None = None
        # oneDNN's blocked copy of the LM head for GEMM rows (process_weights_after_loading "gemm")
        self.gemm_head: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.lora_slots = 0  # adapters one batch can mix (engine/lora/adapters.py); 0: LoRA off
        self.pad_cpu_rows = False  # forward in oneDNN row buckets (padded_rows; set by use_cpu_fused_ops)
        self.cpu_stack: cpu_stack.StackRunner | None = None  # the layers as one C++ call (use_cpu_stack)
        # EAGLE-3 (engine/models/eagle.py): the hidden states entering these layers, side by side, are
        # written into aux_hidden [tokens, len(aux_layers) * hidden] by every forward (a static buffer:
        # decode graphs write it too).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def quantizable_linears(self) -> dict[str, Linear]:
        """The linear layers kiln quantises, by name: every attention and dense-MLP projection (not
        the LM head or the embeddings, which every format here leaves in full precision)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Linear) and name.startswith("layers.")}

    def moe_layers(self) -> list[SparseMoE]:
        """The mixture-of-experts blocks, for the quantisers (engine/layers/quant/moe.py takes layers,
        never the model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        """Give every attention and dense-MLP projection room for num_slots adapters of rank <= max_rank."""
        if self.config.is_moe:
            raise ValueError("LoRA adapters are not supported for mixture-of-experts models")
        if self.tp is not None:
            raise ValueError("enable_lora: LoRA adapters are not supported with tensor_parallel_size > 1 yet")
        self.lora_slots = num_slots
        for module in self.modules():
            if isinstance(module, Linear):
                module.enable_lora(num_slots, max_rank)

    def use_cpu_fused_ops(self, cache_dir: Path | None) -> float:
        """Load (first start: build) compiler/kernels/cpu_fused.py's ops and run this model's norms, rotary
        embeddings and MLP activations through them on the CPU. Returns the seconds spent. A
        library that cannot be built leaves the eager ops on (cpu_fused logs why)."""
        t0 = time.perf_counter()
        if not fuse_cpu_ops(self, cache_dir):
            return time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        # Row buckets end to end pay only where every projection is a dense oneDNN one.
        self.pad_cpu_rows = (
            self.tp is None
            and not self.config.is_moe
            and all(m.quant is None for m in self.modules() if isinstance(m, Linear))
        )
        return seconds

    def use_cpu_stack(self) -> bool:
        """Run the decoder layers as one C++ call per step where they can (engine/models/cpu_stack.py;
        after use_cpu_fused_ops, with the CPU attention and weight-streaming kernels loaded). Returns
        whether it is on (the reason it is not is logged)."""
        self.cpu_stack = cpu_stack.build(self, self.dtype_of_embeddings())
        return self.cpu_stack is not None

    def padded_rows(self, tokens: int, x: torch.Tensor, lora: torch.Tensor | None) -> int:
        """The rows the eager CPU forward runs: `tokens` rounded up to oneDNN's row bucket
        (compiler/kernels/cpu_linear.py), so that every projection takes its input as is instead of
        padding a copy of it (9 copies a step for 2 layers). Padding rows (id 0, position 0) are
        claimed by no sequence: attention writes them as zeros and the caller never sees them."""
        # The compiled and device tests come before any test of `tokens`: under torch.compile a
        # comparison with a symbolic row count is a shape guard (a recompile at 32 rows).
        if (
            torch.compiler.is_compiling()
            or not x.is_cpu
            or not self.pad_cpu_rows
            or lora is not None
            or x.dtype != torch.float32
            or tokens < MIN_ONEDNN_ROWS
        ):
            return tokens
        return row_bucket(tokens)

    def warm_cpu_linear(self, max_tokens: int, max_seqs: int) -> int:
        """Build oneDNN's primitive for every row bucket (compiler/kernels/cpu_linear.py) of the dense float32
        projections (up to max_tokens rows) and the LM head (up to max_seqs sampled rows) now, not
        while serving. Returns the number of shapes built."""
        dense = [(m.weight, m.bias, m.gemm_weight) for m in self.modules() if isinstance(m, Linear) and m.quant is None]
        built = warm_buckets(dense, max_tokens)
        if self.tp is None and (head := self.head_weight()) is not None:
            built += warm_buckets([(head, None, self.gemm_head)], max_seqs)
        return built

    def process_weights_after_loading(self, dtype: torch.dtype, copy: str) -> tuple[int, int, int]:
        """Post-load weight work on the CPU (engine/layers/linear.py): each layer's hook, then the LM
        head's copy. "half": the decoder layers' projections (quantizable_linears) keep exact 2-byte
        weights; the head gets an exact 2-byte copy beside it (half_head, read by decode rows: the
        embedding table, maybe tied, stays float32). "gemm": every dense projection and the head
        (gemm_head) get oneDNN's blocked copy. Returns (layers changed, their bytes saved or copied,
        the head's bytes; 0: no head copy). The builder decides which copies (and logs them)."""
        if copy not in WEIGHT_COPIES:
            raise ValueError(f"process_weights_after_loading: {copy!r} is not one of {WEIGHT_COPIES}")
        linears = (
            self.quantizable_linears().values()
            if copy == "half"
            else [m for m in self.modules() if isinstance(m, Linear)]
        )
        done = [m.process_weights_after_loading(dtype, copy) for m in linears]
        return sum(1 for b in done if b), sum(done), self._head_copy(dtype, copy)

    def _head_copy(self, dtype: torch.dtype, copy: str) -> int:
        """The LM head's copy (unsharded, not GGUF-packed): its bytes saved per decode step ("half")
        or its bytes ("gemm"); 0: none."""
        if self.tp is not None or self.packed_head is not None or not self.config.generates:
            return 0
        head = self.head_weight()
        if copy == "half":
            if dtype != torch.float32 or head.dtype != torch.float32 or not head.is_cpu:
                return 0
            if (half := exact_half(head.data)) is None:
                return 0
            self.half_head = half
            return head.numel() * (head.element_size() - half.element_size())
        if head.dtype != dtype or (packed := pack_for_gemm(head.data)) is None:
            return 0
        self.gemm_head = packed
        return head.numel() * head.element_size()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        ctx: ForwardContext | None = None,
    ) -> torch.Tensor:
        """ids, positions [T] -> final hidden states [T, hidden]. kv_cache: [layers, 2, blocks, bs, Hkv, D].
        ctx: the step's feature inputs (engine/layers/forward_context.py); None: no feature is used."""
        lora = None
        if self.lora_slots and ctx is not None and ctx.lora_slots is not None:  # one-hot of each token's slot
            slots = torch.arange(self.lora_slots, device=input_ids.device)
            lora = (ctx.lora_slots[:, None] == slots).to(self.dtype_of_embeddings())
        tokens = input_ids.shape[0]
        table = self.embed_tokens  # (the file's blocks go with the kernels' projections: no oneDNN row buckets)
        rows = tokens if isinstance(table, BlockEmbedding) else self.padded_rows(tokens, table.weight, lora)
        if rows != tokens:
            input_ids = F.pad(input_ids, (0, rows - tokens))
            positions = F.pad(positions, (0, rows - tokens))
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # Gemma: rounded to the weights' dtype first, as in HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if self.cpu_stack is not None and self.cpu_stack.runs(rows, positions, self.backend, lora):
            # (EAGLE-3's hidden states between layers: the stack copies them into aux_hidden)
            hidden = self.cpu_stack.forward(x, positions, kv_cache, meta, self.aux_hidden, self.aux_layers)
            return hidden if rows == tokens else hidden[:tokens]
        rope = self.rotary(positions, x)
        local = self.rotary_local(positions, x) if self.rotary_local is not None else rope
        delta = None
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                self._keep_aux(i, x, delta, tokens)
            x, delta = layer(
                x, delta, local if layer.self_attn.sliding_window else rope, kv_cache, meta, self.backend, lora
            )
        hidden = self.norm.add_forward(x, delta)[1]
        return hidden if rows == tokens else hidden[:tokens]

    def _keep_aux(self, layer: int, x: torch.Tensor, delta: torch.Tensor | None, tokens: int) -> None:
        """The residual stream entering `layer` (x + its pending delta; x is later added to in
        place) into its slots of aux_hidden."""
        width = self.config.hidden_size
        h = (x if delta is None else x + delta)[:tokens]
        for k, at in enumerate(self.aux_layers):
            if at == layer:
                self.aux_hidden[:tokens, k * width : (k + 1) * width].copy_(h)

    def dtype_of_embeddings(self) -> torch.dtype:
        table = self.embed_tokens
        return table.dtype if isinstance(table, BlockEmbedding) else table.weight.dtype

    def head_weight(self) -> torch.Tensor | None:
        """The LM head's dense weight [vocab, hidden]: lm_head's, or the embedding table when tied;
        None when tied to a GGUF embedding kept in the file's blocks (the head is packed_head)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        return None if isinstance(self.embed_tokens, BlockEmbedding) else self.embed_tokens.weight

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of token ids `ids` (a copy), for compute_logits(head=...)."""
        if self.tp is not None:
            raise ValueError("a draft vocabulary needs an unsharded model")
        weight = self.head_weight()
        if weight is None:  # (tied to the file's blocks: the same rows, dequantised)
            return self.embed_tokens(ids).contiguous()
        return weight.index_select(0, ids.to(weight.device)).contiguous()

    def compute_logits(self, hidden: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the vocabulary, or with `head` (head_rows) over those rows only."""
        if head is not None:
            logits = linear(hidden, head).float()
            cap = self.config.final_softcap
            return cap * torch.tanh(logits / cap) if cap else logits
        weight = self.head_weight()
        if weight is None:  # only the file's blocks: the kernels, or from its gemm_rows rows their GEMM in slices
            assert self.packed_head is not None
            logits = self.packed_head(hidden).float()
        elif self.tp is not None:  # this rank's vocabulary rows, gathered: the full logits on every rank
            logits = parallel_logits(hidden, weight, self.config.vocab_size, self.tp).float()
        elif self.packed_head is not None and hidden.dim() == 2 and hidden.shape[0] < self.packed_head.quant.gemm_rows:
            logits = self.packed_head(hidden).float()
        elif (
            self.half_head is not None
            and hidden.dim() == 2
            and hidden.shape[0] <= cpu_gemv.MAX_DENSE_ROWS.get(hidden.dtype, 0)
        ):
            logits = linear(hidden, self.half_head).float()  # (more rows: the float32 head's GEMM)
        else:
            logits = linear(hidden, weight, None, self.gemm_head).float()
        cap = self.config.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits
