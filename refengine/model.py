"""The lab model: a one-layer, attention-only decoder whose weights are built, not trained,
so that greedy decoding reads back what the request's KV cache holds.

Why it reads back
-----------------
* Values carry the token. Token ``t``'s embedding holds the 9 bits of ``t`` as +-1, tiled
  ``(head_dim - 2) // 9`` times, plus a *segment* feature (1 for tokens fed back during
  decode, 0 for prompt tokens) and an *occupancy* feature that is 1 for every real token.
  ``W_k`` and ``W_v`` are identities, so a written KV slot stores exactly that vector, and
  every entry is -1, 0 or 1: exact in float32, float16 and bfloat16 alike.
* The query at decode step ``j`` (``j`` = tokens generated so far) targets cache position
  ``j``. Like ALiBi, position enters attention as a bias computed at read time,
  ``-slope * |p - j|`` for the slot at position ``p`` of the gathered block table; keys
  themselves hold no position. Hence "position" means "slot of the block table being read":
  pages reached through another request's block table, or stale pages, are read in the order
  of the reader's block table — their text comes out verbatim.
* The content term ``q . k`` rewards occupied slots (``W_q`` maps the occupancy feature to
  ``OCCUPANCY_BONUS``), less than one position step, so it never beats the exact slot; it
  only makes K matter, as in a real model.
* The LM head decodes the attended value back into its token (the transposed code), maps
  the segment feature to EOS, and gives EOS a small bias so that reading an all-zero
  (never written, or zeroized) slot yields EOS.

So after a prompt of ``P`` tokens the outputs are prompt[0], prompt[1], ..., prompt[P-1]
and then EOS (step ``P`` reads slot ``P``, the first token decode wrote, segment 1). A
request whose block table points at another request's pages answers with that request's
text until it meets a slot written during decode or a blank one.

Shapes: ``H`` heads of ``D = head_dim``; every head is identical and the output projection
averages them. K/V rows are ``[N, H, D]``; the pool keeps ``[pages, page_size, H, D]``.
"""

from __future__ import annotations

import torch

from refengine.tokenizer import EOS, VOCAB_SIZE

_BITS = 9  # enough for VOCAB_SIZE <= 512
#: ALiBi-style slope: one position away costs this much score.
SLOPE = 16.0
#: Score for an occupied slot; below SLOPE so position always wins over occupancy.
OCCUPANCY_BONUS = 8.0
#: Logit of the token whose code the attended value matches exactly.
GAIN = 10.0
#: Extra EOS logit per unit of the segment feature; beats GAIN so decode-written slots end
#: generation.
SEGMENT_EOS = 3.0 * GAIN
#: EOS logit when nothing is read (blank slot); below the >= ~1.7 gap a real token leaves.
BLANK_EOS = 0.5


class LabModel:
    """Deterministic weights on ``device``; no state besides them (thread-compatible).

    Invariant: ``embedding`` rows have entries in {-1, 0, 1}; column ``seg_dim`` is 0 and
    column ``occ_dim`` is 1 for every token, and ``segment_embedding[1]`` adds 1 at
    ``seg_dim``.
    """

    def __init__(self, *, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype):
        if head_dim < _BITS + 2:
            raise ValueError(f"head_dim must be >= {_BITS + 2}")
        self.heads = heads
        self.head_dim = head_dim
        self.device = device
        self.dtype = dtype
        self.vocab_size = VOCAB_SIZE
        d = head_dim
        reps = (d - 2) // _BITS
        self.code_dims = _BITS * reps
        self.seg_dim = d - 2
        self.occ_dim = d - 1

        # Built on the CPU in float32 and moved once, so every device gets identical weights.
        ids = torch.arange(VOCAB_SIZE)
        bits = ((ids[:, None] >> torch.arange(_BITS)[None, :]) & 1).float() * 2 - 1
        emb = torch.zeros(VOCAB_SIZE, d)
        emb[:, : self.code_dims] = bits.repeat(1, reps)
        emb[:, self.occ_dim] = 1.0
        seg = torch.zeros(2, d)
        seg[1, self.seg_dim] = 1.0

        eye = torch.eye(d)
        w_kv = eye.repeat(1, heads)  # [D, H*D]: the same identity for every head
        w_q = torch.zeros(d, heads * d)
        for h in range(heads):
            w_q[self.occ_dim, h * d + self.occ_dim] = OCCUPANCY_BONUS
        w_o = eye.repeat(heads, 1) / heads  # [H*D, D]: average of the heads

        w_lm = torch.zeros(d, VOCAB_SIZE)
        w_lm[: self.code_dims, :] = emb[:, : self.code_dims].T * (GAIN / self.code_dims)
        w_lm[self.seg_dim, EOS] = SEGMENT_EOS
        b_lm = torch.zeros(VOCAB_SIZE)
        b_lm[EOS] = BLANK_EOS

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.float32).contiguous()

        self.embedding = put(emb)
        self.segment_embedding = put(seg)
        self.w_k = put(w_kv)
        self.w_v = put(w_kv.clone())
        self.w_q = put(w_q)
        self.w_o = put(w_o)
        self.w_lm = put(w_lm)
        self.b_lm = put(b_lm)

    # -- projections ----------------------------------------------------------------------

    def _x(self, tokens: torch.Tensor, segment: int) -> torch.Tensor:
        return self.embedding.index_select(0, tokens) + self.segment_embedding[segment]

    def kv(self, tokens: torch.Tensor, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows ``[N, H, D]`` in the pool dtype for ``tokens`` ``[N]`` (int64).

        ``segment`` is 0 for prompt tokens (prefill) and 1 for tokens fed back by decode.
        """
        x = self._x(tokens, segment)
        n = tokens.shape[0]
        k = (x @ self.w_k).view(n, self.heads, self.head_dim).to(self.dtype)
        v = (x @ self.w_v).view(n, self.heads, self.head_dim).to(self.dtype)
        return k, v

    def query(self, tokens: torch.Tensor, segment: int) -> torch.Tensor:
        """Content part of the queries ``[B, H, D]`` (float32)."""
        x = self._x(tokens, segment)
        return (x @ self.w_q).view(tokens.shape[0], self.heads, self.head_dim)

    # -- attention ------------------------------------------------------------------------

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos: torch.Tensor,
        owner: torch.Tensor,
        lengths: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy next tokens for ``B`` readers over ``T`` pages of ``S`` KV slots each.

        ``q`` ``[B, H, D]``; ``k``, ``v`` ``[T, S, H, D]`` (any float dtype); ``pos``
        ``[T, S]`` each slot's position in its reader's cache; ``owner`` ``[T]`` the reader
        of each page (0..B-1); ``lengths`` ``[B]`` valid positions per reader (slots at
        ``pos >= length`` are masked); ``targets`` ``[B]`` the position each query aims at.
        Every reader must own at least one valid slot. Returns
        ``(tokens [B] int64, valid [T, S] bool)``.

        Pages of different readers sit in one flat list, so decode gathers each request's
        pages exactly once with no padding to the longest block table. The softmax is taken
        per reader in two levels: dense reductions within each page, then a scatter over
        pages (T entries, not T*S: index_add on the CPU costs per index).
        """
        b, h, d = q.shape
        t = k.shape[0]
        kf = k.float()
        vf = v.float()
        valid = pos < lengths.index_select(0, owner)[:, None]
        bias = (pos - targets.index_select(0, owner)[:, None]).abs().float() * -SLOPE  # [T, S]
        content = torch.einsum("tshd,thd->tsh", kf, q.index_select(0, owner))
        scores = (content + bias[..., None]).masked_fill(~valid[..., None], float("-inf"))
        page_peak = scores.amax(1)  # [T, H]
        peak = torch.full((b, h), float("-inf"), device=q.device).scatter_reduce(
            0, owner[:, None].expand(t, h), page_peak, reduce="amax", include_self=True
        )
        weights = (scores - peak.index_select(0, owner)[:, None, :]).exp()  # masked -> 0
        denom = torch.zeros(b, h, device=q.device).index_add_(0, owner, weights.sum(1))
        page_num = torch.einsum("tsh,tshd->thd", weights, vf)
        num = torch.zeros(b, h, d, device=q.device).index_add_(0, owner, page_num)
        out = (num / denom[..., None]).reshape(b, h * d) @ self.w_o  # [B, D]
        logits = out @ self.w_lm + self.b_lm
        return logits.argmax(-1), valid
