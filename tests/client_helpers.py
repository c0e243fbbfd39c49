"""Real engines' client code, written here in their style at tiny sizes, for tests/test_real_clients.py.

* gpt-fast (pytorch-labs/gpt-fast ``generate.py``, ``model.py``): a Transformer with a static
  ``KVCache`` per layer written at ``input_pos``, ``decode_one_token(model, x, input_pos)`` in a loop
  that advances ``input_pos`` in place, greedy or sampled without a sync (``exponential_``), and
  speculative decoding whose verification calls ``model_forward(model, x, input_pos)``.
* nano-vllm (GeeeekExplorer/nano-vllm ``engine/model_runner.py``, ``utils/context.py``,
  ``layers/``): a paged KV cache of blocks, a block table per sequence, a store that skips slot -1,
  attention that reads ``slot_mapping``, ``context_lens`` and ``block_tables`` from a module-level
  forward context, RMSNorm in place into its float copy, prefill eagerly and decode steps through
  graphs, all under ``torch.inference_mode()``. Its two GPU kernels (the Triton store, FlashAttention)
  are plain torch here, graph-safe (no host reads in a decode step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 64, 32, 2, 4, 2
HEAD_DIM = DIM // HEADS


# ---- gpt-fast -------------------------------------------------------------------------------------


class KVCache(nn.Module):
    """gpt-fast's static cache: [batch, heads, max_seq_length, head_dim], written at input_pos."""

    def __init__(self, max_batch_size: int, max_seq_length: int) -> None:
        super().__init__()
        shape = (max_batch_size, KV_HEADS, max_seq_length, HEAD_DIM)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def update(self, input_pos, k_val, v_val):
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, DIM + 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x, input_pos, mask):
        batch, length, _ = x.shape
        q, k, v = self.wqkv(F.rms_norm(x, (DIM,))).split([DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        h = x + self.wo(y.transpose(1, 2).contiguous().view(batch, length, DIM))
        return h + self.down(F.silu(self.up(F.rms_norm(h, (DIM,)))))


class Transformer(nn.Module):
    """gpt-fast's model: ``setup_caches`` then ``forward(idx, input_pos)`` with masks from input_pos."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        for parameter in self.parameters():  # sharp logits: greedy decoding does not collapse to one token
            parameter.data.mul_(3.0)

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        for layer in self.layers:
            layer.kv_cache = KVCache(max_batch_size, max_seq_length)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool)),
                             persistent=False)

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, mask)
        return self.output(F.rms_norm(x, (DIM,)))


def multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def logits_to_probs(logits, temperature: float = 1.0):
    return torch.nn.functional.softmax(logits / max(temperature, 1e-5), dim=-1)


def sample(logits, temperature: float = 1.0, greedy: bool = False):
    probs = logits_to_probs(logits[:, -1], temperature)
    if greedy:
        return torch.argmax(probs, dim=-1, keepdim=True).to(dtype=torch.int), probs
    return multinomial_sample_one_no_sync(probs), probs


def decode_one_token(model, x, input_pos, greedy: bool = False):
    logits = model(x, input_pos)
    return sample(logits, greedy=greedy)


def model_forward(model, x, input_pos):
    return model(x, input_pos)


@dataclass
class GptFast:
    """The two functions gpt-fast compiles, replaceable by their graphrt-wrapped forms."""

    decode_one_token: Callable = decode_one_token
    model_forward: Callable = model_forward

    def decode_n_tokens(self, model, cur_token, input_pos, num_new_tokens: int, greedy: bool):
        new_tokens, new_probs = [], []
        for _ in range(num_new_tokens):
            next_token, next_prob = self.decode_one_token(model, cur_token, input_pos, greedy)
            input_pos += 1
            new_tokens.append(next_token.clone())
            new_probs.append(next_prob.clone())
            cur_token = next_token.clone()
        return new_tokens, new_probs

    def generate(self, model, prompt, max_new_tokens: int, batch_size: int, greedy: bool = True):
        """gpt-fast's generate() without a draft model: prefill eagerly, then decode_n_tokens."""
        length = prompt.size(-1)
        model.setup_caches(batch_size, length + max_new_tokens)
        with torch.no_grad():
            prompt = prompt.view(1, -1).repeat(batch_size, 1)
            next_token = sample(model(prompt, torch.arange(0, length)), greedy=greedy)[0].clone()
            input_pos = torch.tensor([length], dtype=torch.int)
            tokens, _ = self.decode_n_tokens(model, next_token.view(batch_size, -1), input_pos, max_new_tokens - 1,
                                             greedy)
        return torch.cat([prompt, next_token, *tokens], dim=-1)

    def speculative_decode(self, model, draft_model, cur_token, input_pos: int, speculate_k: int):
        orig_input_pos = torch.tensor([input_pos], dtype=torch.int64)
        draft_tokens, draft_probs = self.decode_n_tokens(draft_model, cur_token.view(1, -1), orig_input_pos.clone(),
                                                         speculate_k, greedy=False)
        draft_tokens = torch.cat(draft_tokens)
        target_logits = self.model_forward(model, torch.cat([cur_token.view(1), draft_tokens.view(-1)]).view(1, -1),
                                           torch.arange(input_pos, input_pos + speculate_k + 1))
        target_probs = logits_to_probs(target_logits[0])
        draft_probs = torch.stack(draft_probs)
        draft_tokens = draft_tokens.view(-1)
        p = draft_probs[torch.arange(0, speculate_k), 0, draft_tokens]
        q = target_probs[torch.arange(0, speculate_k), draft_tokens]
        accept_draft_prob = torch.minimum(torch.ones(()), q[:speculate_k] / p)
        rejected_locations = (torch.rand_like(accept_draft_prob) > accept_draft_prob).nonzero()
        if rejected_locations.shape[0] == 0:  # every draft token accepted
            last_token = multinomial_sample_one_no_sync(target_probs[-1])
            self.model_forward(draft_model, draft_tokens[-1].view(1, -1), orig_input_pos + speculate_k)
            return torch.cat([draft_tokens, last_token])
        accept_length = rejected_locations[0].item()
        new = target_probs[accept_length] - draft_probs[accept_length, 0]
        new = torch.where(new > 0, new, 0.0)
        next_token = multinomial_sample_one_no_sync(new / new.sum())
        return torch.cat([draft_tokens[:accept_length], next_token])

    def speculative_generate(self, model, draft_model, prompt, max_new_tokens: int, speculate_k: int):
        length = prompt.size(-1)
        total = length + max_new_tokens
        for each in (model, draft_model):
            each.setup_caches(1, total + speculate_k + 1)
        with torch.no_grad():
            prompt = prompt.view(1, -1)
            next_token = sample(model(prompt, torch.arange(0, length)))[0].clone()
            sample(draft_model(prompt, torch.arange(0, length)))
            sequence = [next_token.view(-1)]
            input_pos = length
            while input_pos < total - 1:
                next_tokens = self.speculative_decode(model, draft_model, next_token.view(()), input_pos, speculate_k)
                added = min(total - input_pos - 1, len(next_tokens))
                sequence.append(next_tokens[:added])
                input_pos += added
                next_token = next_tokens[-1]
        return torch.cat(sequence)


# ---- nano-vllm ------------------------------------------------------------------------------------


@dataclass
class Context:
    """nano-vllm's forward context: what the attention of one step reads besides its inputs."""

    is_prefill: bool = False
    cu_seqlens: Optional[List[int]] = None  # prefill: host offsets of each sequence's tokens
    slot_mapping: Optional[torch.Tensor] = None
    context_lens: Optional[torch.Tensor] = None
    block_tables: Optional[torch.Tensor] = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(is_prefill: bool, cu_seqlens=None, slot_mapping=None, context_lens=None, block_tables=None) -> None:
    global _CONTEXT
    _CONTEXT = Context(is_prefill, cu_seqlens, slot_mapping, context_lens, block_tables)


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()


@torch.library.custom_op("graphrt_test::store_kvcache", mutates_args=("k_cache", "v_cache"))
def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """nano-vllm's store_kvcache_kernel: row i goes to slot slot_mapping[i]; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, KV_HEADS * HEAD_DIM).index_copy_(0, slots, key[keep].flatten(1))
    v_cache.view(-1, KV_HEADS * HEAD_DIM).index_copy_(0, slots, value[keep].flatten(1))


@store_kvcache.register_fake
def _(key, value, k_cache, v_cache, slot_mapping):
    return None


class RMSNorm(nn.Module):
    """nano-vllm's RMSNorm: in place into the float copy, the residual add fused in."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x, residual=None):
        dtype = x.dtype
        if residual is None:
            x = x.float()
            x.mul_(torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps))
            return x.to(dtype).mul_(self.weight)
        x = x.float().add_(residual.float())
        residual = x.to(dtype)
        x.mul_(torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps))
        return x.to(dtype).mul_(self.weight), residual


class PagedAttention(nn.Module):
    """nano-vllm's Attention: store this step's keys at ``slot_mapping``, then attend over the cache
    through the block table (decode) or over the sequence's own tokens (prefill, eager)."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q, k, v):
        context = get_context()
        store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        if context.is_prefill:
            outputs = []
            for start, end in zip(context.cu_seqlens, context.cu_seqlens[1:]):
                qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
                ks, vs = (t.repeat_interleave(HEADS // KV_HEADS, dim=0) for t in (ks, vs))
                outputs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
            return torch.cat(outputs)
        tables = context.block_tables.clamp(min=0).long()  # [batch, blocks]; -1 marks no block
        batch, blocks = tables.shape
        keys = self.k_cache[tables].view(batch, blocks * self.block_size, KV_HEADS, HEAD_DIM)
        values = self.v_cache[tables].view(batch, blocks * self.block_size, KV_HEADS, HEAD_DIM)
        keys, values = (t.repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2) for t in (keys, values))
        visible = torch.arange(blocks * self.block_size) < context.context_lens[:, None]
        mask = torch.where(visible, 0.0, float("-inf"))[:, None, None, :]
        return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=self.scale)[:, :, 0]


class Qwen3Layer(nn.Module):
    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(DIM)
        self.post_attention_layernorm = RMSNorm(DIM)
        self.qkv_proj = nn.Linear(DIM, DIM + 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.q_norm = RMSNorm(HEAD_DIM)
        self.k_norm = RMSNorm(HEAD_DIM)
        self.attn = PagedAttention(block_size)
        self.gate_up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, positions, hidden, residual):
        hidden, residual = (self.input_layernorm(hidden), hidden) if residual is None else (
            self.input_layernorm(hidden, residual))
        q, k, v = self.qkv_proj(hidden).split([DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = self.q_norm(q.reshape(-1, HEADS, HEAD_DIM))
        k = self.k_norm(k.reshape(-1, KV_HEADS, HEAD_DIM))
        angle = positions[:, None, None].float() * 0.1  # a rotation by position (rotary, simplified)
        q, k = q * torch.cos(angle) + q.roll(1, dims=-1) * torch.sin(angle), k * torch.cos(angle)
        out = self.attn(q, k, v.reshape(-1, KV_HEADS, HEAD_DIM)).reshape(-1, DIM)
        hidden, residual = self.post_attention_layernorm(self.o_proj(out), residual)
        gate, up = self.gate_up(hidden).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), residual


class Qwen3ForCausalLM(nn.Module):
    """nano-vllm's model: ``forward(input_ids, positions)`` to hidden states, ``compute_logits`` apart."""

    def __init__(self, block_size: int, seed: int = 0, layers: int = LAYERS) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Qwen3Layer(block_size) for _ in range(layers))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        for parameter in self.parameters():
            parameter.data.mul_(2.0)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden):
        if get_context().is_prefill:
            hidden = hidden[torch.tensor(get_context().cu_seqlens[1:]) - 1]
        return self.lm_head(hidden)


@dataclass
class Sequence:
    token_ids: List[int]
    max_tokens: int
    block_table: List[int]
    prompt_len: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)

    @property
    def done(self) -> bool:
        return len(self.token_ids) - self.prompt_len >= self.max_tokens


class ModelRunner:
    """nano-vllm's ModelRunner at tiny sizes: the KV cache of blocks, prefill and decode batches
    prepared on the host, the context set before each step, and one of three decode paths:
    ``eager``, ``wrap`` (the step function graphed by graphrt.wrap, the context tensors passed as its
    arguments and set from them inside the step) or ``runner`` (graphrt.GraphRunner over ForwardBatch,
    the context built inside the step from graphrt.current_batch()). ``capture_sizes``: the runner's
    decode graphs (default 1, 2, 4, 8)."""

    def __init__(self, model: Qwen3ForCausalLM, mode: str, block_size: int = 4, num_blocks: int = 48,
                 max_num_seqs: int = 8, max_blocks_per_seq: int = 8,
                 capture_sizes: Optional[List[int]] = None) -> None:
        self.model = model.eval()
        self.block_size, self.max_blocks = block_size, max_blocks_per_seq
        self.kv_cache = torch.zeros(2, len(model.layers), num_blocks, block_size, KV_HEADS, HEAD_DIM)
        for layer_id, layer in enumerate(model.layers):
            layer.attn.k_cache, layer.attn.v_cache = self.kv_cache[0, layer_id], self.kv_cache[1, layer_id]
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.requests = RequestTable(2 * max_num_seqs + 1, max_blocks_per_seq)  # row 0: padding rows' request
        self.mode, self.graphed = mode, None
        if mode == "wrap":
            import graphrt

            self.graphed = graphrt.wrap(self.decode_step, max_batch_size=max_num_seqs,
                                        pad_values={"slot_mapping": -1, "context_lens": 1})
        elif mode == "runner":
            self.graphed = self._graph_runner(max_num_seqs, capture_sizes or [1, 2, 4, 8])

    # -- the graphed steps --------------------------------------------------------------------------

    def decode_step(self, input_ids, positions, slot_mapping, context_lens, block_tables):
        """What wrap() graphs: the context set from the step's own arguments, then the model."""
        set_context(False, slot_mapping=slot_mapping, context_lens=context_lens, block_tables=block_tables)
        return self.model.compute_logits(self.model(input_ids, positions))

    def _graph_runner(self, max_num_seqs: int, capture_sizes: List[int]):
        from graphrt import GraphRunner

        runner = GraphRunner(BatchContextModel(self.model), max_batch_size=max_num_seqs, capture_sizes=capture_sizes,
                             pad_values={"out_cache_loc": -1}, batch_context={"req_to_token_pool": self.requests},
                             progress=False)
        with torch.inference_mode():  # where nano-vllm, vLLM and SGLang capture
            report = runner.capture()
        assert report.failed == {}, report.failed
        return runner

    # -- host side ----------------------------------------------------------------------------------

    def allocate(self, sequence: Sequence) -> None:
        while len(sequence.block_table) * self.block_size < len(sequence.token_ids):
            sequence.block_table.append(self.free_blocks.pop())

    def release(self, sequence: Sequence) -> None:
        self.free_blocks.extend(reversed(sequence.block_table))
        sequence.block_table.clear()

    def slot(self, sequence: Sequence, position: int) -> int:
        return sequence.block_table[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def prefill(self, sequences: List[Sequence]) -> List[int]:
        ids, positions, slots, offsets = [], [], [], [0]
        for sequence in sequences:
            self.allocate(sequence)
            ids += sequence.token_ids
            positions += range(len(sequence.token_ids))
            slots += [self.slot(sequence, p) for p in range(len(sequence.token_ids))]
            offsets.append(len(ids))
        set_context(True, cu_seqlens=offsets, slot_mapping=torch.tensor(slots, dtype=torch.int32))
        logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions)))
        reset_context()
        return logits.argmax(dim=-1).tolist()

    def prepare_decode(self, sequences: List[Sequence]) -> Tuple[torch.Tensor, ...]:
        for sequence in sequences:
            self.allocate(sequence)
        input_ids = torch.tensor([sequence.token_ids[-1] for sequence in sequences])
        positions = torch.tensor([len(sequence.token_ids) - 1 for sequence in sequences])
        slot_mapping = torch.tensor([self.slot(s, len(s.token_ids) - 1) for s in sequences], dtype=torch.int32)
        context_lens = torch.tensor([len(sequence.token_ids) for sequence in sequences], dtype=torch.int32)
        block_tables = torch.tensor([s.block_table + [-1] * (self.max_blocks - len(s.block_table)) for s in sequences],
                                    dtype=torch.int32)
        return input_ids, positions, slot_mapping, context_lens, block_tables

    @torch.inference_mode()
    def decode(self, sequences: List[Sequence]) -> List[int]:
        fields = self.prepare_decode(sequences)
        if self.mode == "runner":
            logits = self.graphed(self.forward_batch(sequences, *fields))
        elif self.mode == "wrap":
            logits = self.graphed(*fields)
        else:  # eager, as nano-vllm's run_model with enforce_eager
            input_ids, positions, slot_mapping, context_lens, block_tables = fields
            set_context(False, slot_mapping=slot_mapping, context_lens=context_lens, block_tables=block_tables)
            logits = self.model.compute_logits(self.model(input_ids, positions))
        reset_context()
        return logits.argmax(dim=-1).tolist()

    def forward_batch(self, sequences, input_ids, positions, slot_mapping, context_lens, block_tables):
        """The decode batch as graphrt's ForwardBatch: each sequence's block table is a row of the
        request table (the ``req_to_token_pool``), written in place; its row index the request index."""
        from graphrt import ForwardBatch, ForwardMode

        rows = torch.tensor([self.requests.row(index, table) for index, table in zip(self.indices(sequences),
                                                                                      block_tables)])
        return ForwardBatch(ForwardMode.DECODE, len(sequences), input_ids, rows, context_lens,
                            slot_mapping.long(), int(context_lens.sum()), positions=positions)

    def indices(self, sequences: List[Sequence]) -> List[int]:
        return [self.sequences.index(sequence) for sequence in sequences]

    def generate(self, prompts: List[List[int]], max_tokens: List[int]) -> Dict[int, List[int]]:
        """nano-vllm's LLMEngine loop, one scheduler step at a time: prefill new sequences, then decode
        every running sequence until each reached its own max_tokens (batches shrink as they finish)."""
        self.requests.req_to_token.fill_(-1)
        sequences = self.sequences = [Sequence(list(prompt), limit, []) for prompt, limit in zip(prompts, max_tokens)]
        for sequence, token in zip(sequences, self.prefill(sequences)):
            sequence.token_ids.append(token)
        running = [sequence for sequence in sequences if not sequence.done]
        while running:
            for sequence, token in zip(running, self.decode(running)):
                sequence.token_ids.append(token)
            for sequence in [s for s in running if s.done]:
                self.release(sequence)
            running = [sequence for sequence in running if not sequence.done]
        return {index: sequence.token_ids[sequence.prompt_len:] for index, sequence in enumerate(sequences)}


class RequestTable:
    """The block table of every running sequence, one row per request (graphrt's ``req_to_token_pool``)."""

    def __init__(self, num_requests: int, max_blocks: int) -> None:
        self.num_requests = num_requests
        self.req_to_token = torch.full((num_requests, max_blocks), -1, dtype=torch.int32)

    def row(self, index: int, table: torch.Tensor) -> int:
        """Sequence ``index``'s row (row 0 is the padding rows'), its block table written in place."""
        self.req_to_token[index + 1] = table
        return index + 1


class BatchContextModel(nn.Module):
    """The GraphRunner form of nano-vllm's model call: the context is built inside the step from the
    batch it runs on (``graphrt.current_batch()``: in a graph, the static batch a replay restages)."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, forward_batch):
        import graphrt

        batch = graphrt.current_batch()
        set_context(False, slot_mapping=batch.out_cache_loc, context_lens=batch.seq_lens,
                    block_tables=batch.req_to_token_pool.req_to_token[batch.req_pool_indices])
        return self.model.compute_logits(self.model(input_ids, positions))
