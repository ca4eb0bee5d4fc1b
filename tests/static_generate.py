"""grpo.generate as it was before issue 19 (the static KV cache, one prefill per distinct prompt),
kept verbatim with its KVCache as bench.py's `static` contender: fp32 keys under bf16 autocast,
every step attending over all P + max_new_tokens columns, every row decoded until the longest
completion ends. Only the names changed (StaticKVCache, static_generate)."""

import torch

from common import cache_argument, cuda_graph
from grpo import top_p_filter


class StaticKVCache:
    """The keys and values of every layer for N rows and S = P + max_new_tokens positions, in
    buffers allocated once and written in place: generate passes it to the model as
    past_key_values. transformers' attention layers call update() with the keys and values of
    the tokens they just computed and attend over what it returns; generate sets the columns
    they go to (slots) and, with the attention mask, which columns each row may attend to."""

    def __init__(self, rows: int, length: int):
        self.rows, self.length = rows, length  # N, S
        self.keys, self.values = [], []  # a (N, kv heads, S, head dim) buffer per layer
        self.slots = None  # (q,) the columns the next forward pass writes: 0 … P-1, then one per token

    def update(self, keys, values, layer: int, *unused, **unused_named):  # keys, values (n, kv heads, q, head dim)
        if layer == len(self.keys):  # the first pass allocates, from the shapes and dtype it brings
            shape = (self.rows, keys.shape[1], self.length, keys.shape[3])
            self.keys.append(keys.new_zeros(shape))
            self.values.append(values.new_zeros(shape))
        rows = keys.shape[0]  # the prefill runs on the distinct prompts only: the first rows
        self.keys[layer][:rows].index_copy_(2, self.slots, keys)
        self.values[layer][:rows].index_copy_(2, self.slots, values)
        return self.keys[layer][:rows], self.values[layer][:rows]

    def repeat_rows(self, counts: torch.Tensor) -> None:
        """After the prefill: the first len(counts) rows, row i repeated counts[i] times, fill all N."""
        for buffer in self.keys + self.values:
            buffer.copy_(buffer[: len(counts)].repeat_interleave(counts, dim=0, output_size=self.rows))


@torch.no_grad()
def static_generate(
    model,
    prompt_ids: torch.Tensor,  # (N, P) left padded
    prompt_mask: torch.Tensor,  # (N, P) 1 for prompt tokens, 0 for padding
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    vocab_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    check_every: int = 16,
):
    """Autoregressive sampling with a KV cache: one forward pass over the prompts, then one
    single-token pass per new token that reuses every earlier key and value.

    temperature 0 means greedy. Only ids below vocab_size are ever sampled (Qwen's embedding
    has ~270 more rows than its tokenizer has tokens). A completion ends with the first EOS
    id it samples; that EOS is part of the completion (it is what teaches the model to stop),
    and later positions hold pad_id with mask 0. Returns
      completion_ids  (N, T) T ≤ max_new_tokens: the longest completion, right padded
      completion_mask (N, T) 1 up to and including the EOS
      truncated       (N,)   True where no EOS came within max_new_tokens
      sample_logp     (N, T) log π(token) under the sampling distribution, before top-p
                             (the one sequence_logprobs scores), 0 where masked

    What makes it fast, none of which changes a number:
    - the cache (KVCache) and the attention mask are allocated once, for P + max_new_tokens
      positions, and written in place: nothing grows by torch.cat;
    - encode_prompts repeats each prompt G times in a row: each distinct prompt is prefilled
      once and its keys and values copied into the rows of its G completions;
    - the host learns whether every row has ended only every check_every tokens, so the GPU
      never waits for it; the tokens drawn past the last EOS are cut off, and the random
      generator is set back to where it stood after the last token kept;
    - on CUDA the one-token step is captured once as a CUDA graph and replayed (cuda_graph);
      on the CPU, and under torchrun, the same step runs eagerly: FSDP2's root pre-forward hook
      makes its all-gather streams wait on the current stream, which a capture cannot join.
    The mask is an additive (N, 1, q, S) bias, transformers' 4D format: the model uses it as
    it is (sdpa and eager attention, its defaults, take it).
    """
    was_training = model.training
    model.eval()  # no dropout, and gradient checkpointing (train-mode only) keeps the cache
    device = prompt_ids.device
    cuda = device.type == "cuda"
    if cuda and device.index != torch.cuda.current_device():  # streams and graphs go to the current device
        raise ValueError(f"generate on {device} while cuda:{torch.cuda.current_device()} is current: set_device first")
    num_rows, prompt_length = prompt_ids.shape  # N, P
    length = prompt_length + max_new_tokens  # S
    masked = -1e30  # the bias of a position not attended to: exp() of it is 0, finite in bf16 and fp32
    eos = torch.tensor(eos_ids, device=device)
    cache = StaticKVCache(num_rows, length)

    # Prefill each distinct prompt once (B rows), then copy its keys and values G times.
    distinct, counts = torch.unique_consecutive(torch.cat([prompt_ids, prompt_mask], -1), dim=0, return_counts=True)
    distinct_ids, distinct_mask = distinct[:, :prompt_length], distinct[:, prompt_length:]  # (B, P)
    # Left padding shifts every prompt; positions count real tokens only, so a prompt
    # scores the same whatever batch it is in.
    position_ids = (distinct_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    causal = torch.ones(prompt_length, prompt_length, dtype=torch.bool, device=device).tril()  # (P, P) keys ≤ query
    visible = torch.zeros(len(counts), prompt_length, length, dtype=torch.bool, device=device)  # (B, P, S)
    visible[..., :prompt_length] = causal & distinct_mask[:, None, :].bool()  # the rest of S is not written yet
    cache.slots = torch.arange(prompt_length, device=device)
    out = model(
        input_ids=distinct_ids,
        attention_mask=torch.where(visible, 0.0, masked)[:, None],  # (B, 1, P, S) causal, padding hidden
        position_ids=position_ids,
        **{cache_argument(model): cache},
        use_cache=True,
        logits_to_keep=1,
    )
    cache.repeat_rows(counts)
    logits = out.logits[:, -1, :vocab_size].float().repeat_interleave(counts, dim=0, output_size=num_rows)  # (N, V)

    # The one-token step reads these buffers, which change only in place.
    token_in = torch.full((num_rows, 1), pad_id, device=device)  # (N, 1) the token just sampled
    position = position_ids[:, -1:].repeat_interleave(counts, dim=0, output_size=num_rows) + 1  # (N, 1)
    cache.slots = torch.tensor([prompt_length], device=device)  # (1,) the column its key and value go to
    bias = torch.full((num_rows, 1, 1, length), masked, device=device)  # (N, 1, 1, S)
    bias[:, 0, 0, :prompt_length].masked_fill_(prompt_mask.bool(), 0.0)  # the prompt, not its padding

    def step():
        out = model(
            input_ids=token_in,
            attention_mask=bias,
            position_ids=position,
            **{cache_argument(model): cache},
            use_cache=True,
        )
        return out.logits[:, -1, :vocab_size].float()  # (N, V) ids ≥ vocab_size are cut off

    if cuda and not torch.distributed.is_initialized():
        step = cuda_graph(step)
    completion_ids = torch.full((num_rows, max_new_tokens), pad_id, device=device)  # (N, max_new_tokens)
    completion_mask = torch.zeros(num_rows, max_new_tokens, dtype=torch.long, device=device)
    sample_logp = torch.zeros(num_rows, max_new_tokens, device=device)
    finished = torch.zeros(num_rows, dtype=torch.bool, device=device)
    rng_states = []  # rng_states[t]: the state of the random generator before token t was drawn
    for t in range(max_new_tokens):
        # logit − logsumexp, the formula sequence_logprobs scores with, not F.log_softmax: on the
        # CPU that kernel sums exp(x − max) in 16 (AVX-512) or 8 (AVX2) fp32 running sums, and in
        # the one holding the max (exp 0 = 1) every later term below 2^-24 rounds away. A confident
        # model over a 150k vocabulary then gets log π of every token ~1e-5 too high.
        if temperature > 0:
            rng_states.append(torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state())
            scaled = logits / temperature  # (N, V)
            logp = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)  # (N, V)
            token = torch.multinomial(top_p_filter(logp.exp(), top_p), 1).squeeze(-1)  # (N,)
            token_logp = logp.gather(-1, token[:, None]).squeeze(-1)  # (N,)
        else:  # greedy: the log-probability of the chosen token only, no (N, V) log-softmax
            token = logits.argmax(dim=-1)  # (N,)
            token_logp = logits.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (N,)
        alive = ~finished
        completion_ids[:, t] = torch.where(alive, token, pad_id)
        completion_mask[:, t] = alive
        sample_logp[:, t] = torch.where(alive, token_logp, 0.0)
        finished = finished | (alive & torch.isin(token, eos))
        if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and finished.all()):  # the only host sync
            break
        token_in.copy_(completion_ids[:, t : t + 1])
        bias.index_fill_(-1, cache.slots, 0.0)  # every later token attends to this one
        logits = step()  # (N, V)
        position += 1
        cache.slots += 1
    model.train(was_training)
    num_tokens = completion_mask.sum(-1).max().item()  # T: the longest completion, its EOS included
    if num_tokens < len(rng_states):  # tokens were drawn past the last EOS: as if they never were
        if cuda:
            torch.cuda.set_rng_state(rng_states[num_tokens], device)
        else:
            torch.set_rng_state(rng_states[num_tokens])
    cut = slice(0, num_tokens)
    return (
        completion_ids[:, cut].contiguous(),
        completion_mask[:, cut].contiguous(),
        ~finished,
        sample_logp[:, cut].contiguous(),
    )
