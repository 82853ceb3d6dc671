"""A block drafter's first attention layer started as a copy mechanism (recipe `draft.init_copy: trained` or `frozen`).

Prompt lookup, free, gets ~46% of SmolLM2's held-out answer tokens right (the token after an earlier occurrence of
the pending token), and a block drafter trained from N(0, 0.02) learns none of it at CPU scale
(benchmarks/README.md, "Copying from the context"). The drafter can copy without a new part: its context keys/values
are its own projections of the target's states. So layer 0's attention starts as one:

- match: the pending token's embedding (the block's anchor slot) is the query; the key of context position j is a
  linear read of the token at j from the first captured layer (a ridge fit on the cache; 99.8% of the held-out
  lookup positions find the same token at 576 dimensions, ~81% at the 24 used here). The match lives in each head's
  lowest-frequency RoPE dimensions, where hundreds of positions apart barely rotate.
- value: what the target predicts after position j (a ridge fit of the last captured layer to the target's final-norm
  state), its 64 leading directions per key/value head, written back into the residual stream by o_proj.

fc's first rows feed both; its other rows, the other layers and heads keep their N(0, 0.02) start. Untrained, the
drafter's first draft is then right at ~35% of the positions where lookup is right (a trained drafter: 24%). Trained
with the rest (`trained`) that fades within ~100 steps; kept as fitted (`frozen`, the smollm2 DSpark recipe) it stays,
and held-out tau at 560 steps was 1.348 against the plain start's 1.312. The weights keep the draft's names and
shapes: export and serving see an ordinary drafter.

`draft.copy_follows: text` copies what prompt lookup copies, the token that followed the match, not the target's
prediction there (which differs from the text in a prompt: a signature or figures restated): the key of position j is
a read of token j-1 from the first captured layer (on SmolLM2 the best of the five at it: in the 24 match dimensions it
names token j-1 at 27% of held-out positions, token j at 33%; benchmarks/copy_probe.py), so the match lands one
position after the earlier occurrence, and the value is a read of that position's token from the same layer, fitted to
the final-norm state that predicts it (measured: benchmarks/README.md, "The four families at equal time").
"""

from __future__ import annotations

import torch

MATCH_DIMS = 24  # per head: the 12 lowest-frequency RoPE pairs
QUERY_GAIN = 6.0  # q_norm weight on those dims: a match scores ~30 logits above a miss
OUTPUT_GAIN = 30.0  # the copied prediction's size in the residual stream against the anchor's embedding


def _ridge(gram: torch.Tensor, cross: torch.Tensor, lam: float) -> torch.Tensor:
    """[D, E] least squares x @ W ~ y from gram = x^T x and cross = x^T y, with an L2 penalty scaled to x's energy."""
    energy = gram.diagonal().sum() / gram.shape[0]
    return torch.linalg.solve(gram + lam * energy * torch.eye(gram.shape[0], dtype=gram.dtype), cross)


def _leading_directions(gram: torch.Tensor, read: torch.Tensor, count: int) -> torch.Tensor:
    """[count, E] the principal directions of x @ read (the top eigenvectors of read^T x^T x read)."""
    values, vectors = torch.linalg.eigh(read.T @ gram @ read)
    return vectors[:, values.argsort(descending=True)[:count]].T


def fit_copy_maps(draft, cache, kv_heads: int | None = None, max_records: int = 128,
                  follows: str = "prediction") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(match_read [H, H], match_dirs [m, H], value_read [H, H], value_dirs [kv*hd, H]) from the first cached
    conversations: first captured layer -> the token's embedding, last captured layer -> the final-norm state, and the
    leading directions of each read (position 0, the attention sink, left out); follows="text": first captured layer
    -> the previous token's embedding, and -> the final-norm state one position back. Sums of products only, so the
    memory is a few [H, H] matrices whatever the data; with online hidden states the target computes them, 8 records
    at a time. The ridge penalty keeps the fit defined on few positions (a test's handful), if poor."""
    config = draft.config
    hidden, layers = config.hidden_size, len(config.target_layer_ids)
    embed = draft.embed_tokens.weight.detach().cpu().double()
    sums = {name: torch.zeros(hidden, hidden, dtype=torch.float64) for name in ("ff", "fe", "ll", "lf")}
    count = min(len(cache), max_records)
    if not count:
        raise ValueError("draft.init_copy fits the copy attention on the training data, and there is none")
    for start in range(0, count, 8):
        for record in cache.with_hidden([cache[i] for i in range(start, min(start + 8, count))]):
            states = record["hidden_states"][1:].cpu().double().view(-1, layers, hidden)
            ids, final = record["input_ids"].long().cpu(), record["last_hidden_state"].cpu().double()
            first = states[:, 0]
            # what position j's key names and what its value carries
            named, value_in, value_out = ((ids[1:], states[:, -1], final[1:]) if follows == "prediction"
                                          else (ids[:-1], first, final[:-1]))
            sums["ff"] += first.T @ first
            sums["fe"] += first.T @ embed[named]
            sums["ll"] += value_in.T @ value_in
            sums["lf"] += value_in.T @ value_out
    match_read = _ridge(sums["ff"], sums["fe"], 1e-2)
    value_read = _ridge(sums["ll"], sums["lf"], 1e-3)
    attn = draft.layers[0].self_attn
    return (match_read, _leading_directions(sums["ff"], match_read, MATCH_DIMS),
            value_read, _leading_directions(sums["ll"], value_read, _copy_heads(attn, kv_heads)[0] * attn.head_dim))


def _copy_heads(attn, kv_heads: int | None) -> tuple[int, int]:
    """(key/value heads, query heads) that copy: the first `kv_heads` (None: all) and their query heads. All copy in
    the recipes: on SmolLM2 one of three, leaving the others free to train, gave 1.333 held-out at 560 steps frozen,
    all three 1.348 (benchmarks/README.md, "Copying from the context")."""
    kv_heads = attn.num_kv_heads if kv_heads is None else min(kv_heads, attn.num_kv_heads)
    return kv_heads, kv_heads * attn.num_heads // attn.num_kv_heads


@torch.no_grad()
def init_copy_attention(draft, cache, kv_heads: int | None = None, follows: str = "prediction") -> None:
    """Layer 0's attention of a DSpark/DFlash draft (its first `kv_heads` key/value heads and their query heads; None:
    all), fc's first rows and hidden_norm set as the module docstring says; `follows`: draft.copy_follows."""
    if follows not in ("prediction", "text"):
        raise ValueError(f"draft.copy_follows={follows!r}: prediction or text")
    match_read, match_dirs, value_read, value_dirs = (
        t.float() for t in fit_copy_maps(draft, cache, kv_heads, follows=follows))
    hidden = draft.config.hidden_size
    attn = draft.layers[0].self_attn
    head_dim, heads, groups = attn.head_dim, attn.num_heads, attn.num_kv_heads
    if heads % groups or head_dim % 2 or MATCH_DIMS > head_dim:
        raise ValueError(f"draft.init_copy needs heads ({heads}) a multiple of kv heads ({groups}) and head_dim "
                         f"({head_dim}) even and >= {MATCH_DIMS}")
    copy_kv, copy_q = _copy_heads(attn, kv_heads)
    m, v = MATCH_DIMS, copy_kv * head_dim
    if m + v > hidden:
        raise ValueError(f"draft.init_copy needs {m + v} context dimensions, the draft has {hidden}")
    fc = draft.fc.weight
    fc[: m + v] = 0.0
    fc[:m, :hidden] = match_dirs @ match_read.T  # ctx[:m]: the token at j (or j-1), in the match directions
    # ctx[m:m+v]: the target's prediction at j (from the last captured layer), or what predicts token j (the first)
    value_columns = slice(-hidden, None) if follows == "prediction" else slice(0, hidden)
    fc[m: m + v, value_columns] = value_dirs @ value_read.T
    draft.hidden_norm.weight.fill_(1.0)
    # RoPE pairs dims (i, i + head_dim/2); the last pairs turn slowest
    half = head_dim // 2
    low = torch.arange(half - m // 2, half)
    dims = torch.cat([low, low + half])
    attn.q_proj.weight[: copy_q * head_dim] = 0.0
    attn.k_proj.weight[: copy_kv * head_dim] = 0.0
    attn.v_proj.weight[: copy_kv * head_dim] = 0.0
    attn.o_proj.weight[:, : copy_q * head_dim] = 0.0
    group = heads // groups
    for g in range(copy_kv):
        attn.k_proj.weight[g * head_dim + dims, torch.arange(m)] = 1.0
        attn.v_proj.weight[g * head_dim: (g + 1) * head_dim, m + g * head_dim: m + (g + 1) * head_dim] = \
            torch.eye(head_dim)
        for h in range(g * group, (g + 1) * group):
            attn.q_proj.weight[h * head_dim + dims] = match_dirs
            attn.o_proj.weight[:, h * head_dim: (h + 1) * head_dim] = \
                value_dirs[g * head_dim: (g + 1) * head_dim].T * (OUTPUT_GAIN / group)
    attn.q_norm.weight.fill_(1.0)
    attn.q_norm.weight[dims] = QUERY_GAIN
    attn.k_norm.weight.fill_(1.0)


def freeze_copy_attention(draft, kv_heads: int | None = None) -> None:
    """Keep the fitted copy path as fitted while the rest of the drafter trains (draft.init_copy: frozen): layer 0's
    copying heads' projections and layer 0's q/k norms frozen, and fc's rows that feed them: their gradient is zeroed
    (so AdamW, whose moments stay zero there, never moves them; a train.weight_decay above 0 would still shrink them,
    so a recipe with both is refused). Trained along with the rest, the copy start was gone within ~100 steps
    (benchmarks/README.md, "Copying from the context")."""
    attn = draft.layers[0].self_attn
    copy_kv, copy_q = _copy_heads(attn, kv_heads)
    attn.q_norm.requires_grad_(False)
    attn.k_norm.requires_grad_(False)
    _keep(draft.fc.weight, slice(0, MATCH_DIMS + copy_kv * attn.head_dim))
    _keep(attn.q_proj.weight, slice(0, copy_q * attn.head_dim))
    _keep(attn.k_proj.weight, slice(0, copy_kv * attn.head_dim))
    _keep(attn.v_proj.weight, slice(0, copy_kv * attn.head_dim))
    _keep(attn.o_proj.weight, (slice(None), slice(0, copy_q * attn.head_dim)))


def _keep(weight: torch.Tensor, index) -> None:
    """Zero `weight`'s gradient at `index` on every backward."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[index] = 0.0
        return grad

    weight.register_hook(hook)
