"""Actor (subgroup PPO-clip, SPEC §2) and extractor (CISPO, SPEC §3) losses.

Batch layout (a dict of arrays; B rows = trajectories / extractor samples, T = padded sequence length):

==================  ============  ==========================================================================
key                 shape, dtype  meaning
==================  ============  ==========================================================================
``tokens``          [B, T] int32  the whole multi-turn conversation, left-aligned, padded on the right
``positions``       [B, T] int32  RoPE positions (0, 1, ... over the valid tokens)
``attn_mask``       [B, T] bool   True on real tokens (False = padding)
``loss_mask``       [B, T] f32    1 on tokens the policy generated (assistant tokens of *every* turn, incl.
                                  their closing ``<|im_end|>``); 0 on prompt / observation / experience
``old_logprobs``    [B, T] f32    log π_old(token t | tokens < t), aligned to the token; 0 where
                                  ``loss_mask`` is 0 (see :func:`comprl_jax.rl.update.make_logprob_fn`)
``advantages``      [B] f32       one scalar per trajectory (actor: :func:`~.advantages.subgroup_advantages`;
                                  extractor: :func:`~.advantages.extractor_advantages`)
``subgroup``        [B] int32     actor only: 0 = experience-free, 1 = experience-guided
``sample_weight``   [B] f32       extractor only: Eq. 7 count-aware weights (from the experience buffer)
``sft_row``         [B] f32       actor, only with ``sft_coef > 0``: 1 = a self-distillation SFT row (an
                                  experience-stripped guided trajectory), excluded from the PPO term
==================  ============  ==========================================================================

Token 0 of a row has no prediction (nothing precedes it): its logprob is defined as 0 and it must not be in
``loss_mask``.

**Packed layout** (sequence packing, :mod:`comprl_jax.roles.packing`): several episodes share a row. The ``[B, T]``
keys above are then ``[R, L]`` (packed rows; ``positions`` restart at 0 per segment, token 0 of every segment out
of ``loss_mask``), the per-row keys ``[B]`` move into ``batch["episodes"]`` as ``[E]`` per-episode arrays, and two
keys map tokens to episodes:

==================  ============  ==========================================================================
``segment_ids``     [R, L] int32  0 = padding, 1, 2, ... = the row's segments (the model's attention mask)
``episode``         [R, L] int32  the token's episode: an index into the ``episodes`` arrays (padding: any)
``episodes``        {key: [E]}    ``advantages``, ``subgroup``, ``sample_weight``, ``sft_row``, ... per episode
==================  ============  ==========================================================================

Every per-sequence quantity (sequence lengths, the sequence log-ratio, per-subgroup cells, per-episode metrics) is a
reduction over the episode index (:class:`Episodes`: ``jax.ops.segment_sum`` into ``[E]``) and is broadcast back
to tokens by a gather, so a packed batch gives the unpacked batch's losses, metrics and gradients. The update never
splits ``episodes`` over micro-batches: each micro-batch sees all of them and counts an episode's per-episode
metrics only where the episode has tokens (:attr:`Episodes.present`).

Exact micro-batching: every aggregation (token mean, sequence mean, per-subgroup mean) is a *weighted sum*
``Σ_bt w_bt ℓ_bt`` whose weights depend only on the masks of the **full** batch. :func:`aggregation_weights`
computes them once, before the batch is split; each micro-batch then contributes a plain sum, so summing
micro-batch losses (and gradients) reproduces the full-batch value exactly. Metrics are returned as
``name -> (numerator, denominator)`` pairs for the same reason; :func:`finalize_metrics` divides once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from comprl_jax.rl.advantages import NUM_SUBGROUPS
from comprl_jax.runtime.fields import FieldError, from_section

LOSS_AGGS = ("token_mean", "seq_mean_token_mean")
RATIOS = ("token", "sequence")
SUBGROUP_NAMES = ("free", "guided")
TOKEN_WEIGHT = "token_weight"  # batch keys the update step adds: [B, T] full-batch aggregation weights
SFT_WEIGHT = "sft_weight"
# The packed layout (module docstring): segment ids and episode index per token, per-episode arrays.
SEGMENT_IDS = "segment_ids"
EPISODE = "episode"
EPISODES = "episodes"
# Loss fields the trainer derives from other config keys (not set in c.<role>.loss).
DERIVED_FIELDS = {"sft_coef": "actor.self_distill_coef (only when self-distillation rows exist)"}


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
    """Actor loss (SPEC §2). Defaults follow the spec.

    Attributes:
      clip_eps: PPO clip ε.
      ratio: ``"token"`` (per-token ρ) | ``"sequence"`` (length-normalised ``exp(mean_t log ρ_t)``).
      loss_agg: ``"token_mean"`` | ``"seq_mean_token_mean"``, applied *inside* each subgroup.
      subgroup_mean: J = ½ Σ_c J_c, each subgroup aggregated on its own (paper Eq. 4). False = one aggregate
        over the whole batch (the released code). With a single subgroup (GRPO baseline) both agree.
      sft_coef: weight of the self-distillation SFT term (SPEC §7); 0 = off.
      compute_entropy: report the policy entropy (costs one extra pass over the logits, no gradient).
    """

    clip_eps: float = 0.2
    ratio: str = "token"
    loss_agg: str = "token_mean"
    subgroup_mean: bool = True
    sft_coef: float = 0.0
    compute_entropy: bool = True
    DERIVED: ClassVar[dict] = DERIVED_FIELDS  # not config keys (runtime.fields.from_section refuses them)

    def __post_init__(self):
        _check_field(self, "actor", "ratio", self.ratio in RATIOS, f"must be one of {RATIOS}")
        _check_field(self, "actor", "loss_agg", self.loss_agg in LOSS_AGGS, f"must be one of {LOSS_AGGS}")
        _check_field(self, "actor", "clip_eps", 0.0 < self.clip_eps < 1.0, "must be in (0, 1)")
        _check_field(self, "actor", "sft_coef", self.sft_coef >= 0, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class ExtractorLossConfig:
    """Extractor CISPO loss (SPEC §3).

    Attributes:
      clip_eps: ε of the stop-gradient IS-weight clip ``clip(ρ, 1-ε, 1+ε)``.
      loss_agg: ``"token_mean"`` (default: ``/ Σ_i |m_i|``) | ``"seq_mean_token_mean"``.
      compute_entropy: as for the actor.
    """

    clip_eps: float = 0.1
    loss_agg: str = "token_mean"
    compute_entropy: bool = True

    def __post_init__(self):
        _check_field(self, "extractor", "loss_agg", self.loss_agg in LOSS_AGGS, f"must be one of {LOSS_AGGS}")
        _check_field(self, "extractor", "clip_eps", 0.0 < self.clip_eps < 1.0, "must be in (0, 1)")


class LossConfigError(FieldError):
    """A bad loss-config value; ``field`` names it (``runtime.fields.from_section`` turns it into the config key)."""

    def __init__(self, role: str, field: str, reason: str, value):
        super().__init__(field, reason, value)
        self.args = (f"{role}.{field} {reason}, got {value!r}",)


def _check_field(cfg, role: str, field: str, ok: bool, reason: str) -> None:
    if not ok:
        raise LossConfigError(role, field, reason, getattr(cfg, field))


def loss_config(c, role: str, **extra):
    """The run config's ``c.<role>.loss`` section as its loss dataclass (:class:`ActorLossConfig` /
    :class:`ExtractorLossConfig`), which checks its values. ``extra``: fields the trainer derives (the actor's
    ``sft_coef``). Raises ValueError naming the config key (``actor.loss.clip_eps``)."""
    cls = {"actor": ActorLossConfig, "extractor": ExtractorLossConfig}[role]
    return from_section(cls, c[role].loss, f"{role}.loss", **extra)


def token_logprobs(logits, tokens, compute_entropy: bool = False):
    """Log-probability of each token given its prefix, in float32, gathering only the target.

    Works on the full ``[B, T, V]`` logits against the *next* token and shifts the small ``[B, T]`` result,
    rather than slicing ``logits[:, :-1]`` (a copy of the largest activation). The target is picked with a
    compare-and-select reduction, which XLA fuses with the logsumexp pass; its backward is an elementwise select
    instead of a scatter into ``[B, T, V]``.

    Args:
      logits: ``[B, T, V]``; position t predicts token t + 1.
      tokens: ``[B, T]`` int.
    Returns:
      ``(logprobs [B, T], entropy [B, T] or None)``, aligned to the token (column 0 = 0).
    """
    lp, ent = _next_token_terms(logits, _next_tokens(tokens), compute_entropy)
    return _shift(lp), (None if ent is None else _shift(ent))


def _next_tokens(tokens):
    """``[B, T]`` -> the token each position predicts (last column: a dummy target, dropped by :func:`_shift`)."""
    tokens = tokens.astype(jnp.int32)
    return jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)


def _shift(x):
    """Value at t predicts t + 1 -> align it to the predicted token (column 0 = 0)."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def _next_token_terms(logits, nxt, compute_entropy: bool):
    """``(log p(nxt) [..], entropy [..] or None)`` per position of ``logits [.., V]``, in float32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    vocab_ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    target = jnp.sum(jnp.where(vocab_ids == nxt[..., None], logits, 0.0), axis=-1)
    if not compute_entropy:
        return target - lse, None
    # H = lse - Σ p·logits; a metric only, so no gradient flows through it.
    lg, lse_sg = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
    return target - lse, lse_sg - jnp.sum(jnp.exp(lg - lse_sg[..., None]) * lg, axis=-1)


def chunked_token_logprobs(head_fn, hidden, tokens, chunk: int, compute_entropy: bool = False):
    """:func:`token_logprobs` from hidden states, ``chunk`` positions at a time (same values, same gradients).

    The ``[B, T, V]`` logits are the largest activation of an update (Qwen2.5-7B at T = 32k: 20 GB in float32
    per sequence, twice that with its cotangent). Here each chunk's logits ``[B, C, V]`` are made by ``head_fn``
    inside a ``jax.checkpoint``-ed ``lax.map`` body: the forward keeps only ``[B, T]`` results and the backward
    recomputes one chunk's logits at a time, so peak logits memory is ``B·C·V`` instead of ``B·T·V``.

    Args:
      head_fn: ``hidden [B, C, D] -> logits [B, C, V]`` (closes over the parameters it differentiates).
      hidden: ``[B, T, D]`` final-normed hidden states; position t predicts token t + 1.
      tokens: ``[B, T]`` int.
      chunk: positions per chunk; ``T`` is padded up to a multiple of it (padding is dropped).
    Returns:
      ``(logprobs [B, T], entropy [B, T] or None)`` exactly as :func:`token_logprobs` on ``head_fn(hidden)``.
    """
    if chunk < 1:
        raise ValueError(f"logits chunk must be >= 1, got {chunk}")
    b, t = tokens.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    nx = jnp.pad(_next_tokens(tokens), ((0, 0), (0, pad)))
    h = h.reshape(b, n, chunk, h.shape[-1]).swapaxes(0, 1)  # [n, B, C, D]
    nx = nx.reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        hc, tc = args
        lp, ent = _next_token_terms(head_fn(hc), tc, compute_entropy)
        return lp, (jnp.zeros_like(lp) if ent is None else ent)

    lp, ent = jax.lax.map(one, (h, nx))

    def unchunk_shift(x):  # [n, B, C] -> [B, T], aligned to the predicted token
        return _shift(x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t])

    return unchunk_shift(lp), (unchunk_shift(ent) if compute_entropy else None)


def is_packed(batch) -> bool:
    """Whether ``batch`` has the packed layout (several episodes per row; module docstring)."""
    return EPISODES in batch


def per_episode(batch, key: str):
    """The per-episode array ``key``: ``[B]`` of the row layout, ``[E]`` of the packed one."""
    return batch[EPISODES][key] if is_packed(batch) else batch[key]


@dataclasses.dataclass(frozen=True)
class Episodes:
    """How a (micro-)batch's tokens map to its episodes.

    Row layout (``episode is None``): episode b = row b, ``E = B``; a per-episode sum is a row sum. Packed layout:
    ``episode [R, L]`` indexes ``E`` episodes; a per-episode sum is a ``segment_sum`` over it (an episode never
    spans rows, so a micro-batch holds each of its episodes whole).

    Attributes:
      episode: ``[R, L]`` int32, or None for the row layout.
      present: ``[E]`` float32, 1 for episodes with a token in this (micro-)batch (row layout: every row).
      num: ``E``.
    """

    episode: jax.Array | None
    present: jax.Array
    num: int

    @classmethod
    def of(cls, batch, like) -> Episodes:
        """The map of ``batch``; ``like``: one of its ``[R, T]`` arrays (the loss mask)."""
        if not is_packed(batch):
            return cls(None, jnp.ones(like.shape[:1], jnp.float32), like.shape[0])
        episode = jnp.asarray(batch[EPISODE], jnp.int32)
        num = jnp.shape(batch[EPISODES]["advantages"])[0]
        valid = (jnp.asarray(batch[SEGMENT_IDS]) > 0).astype(jnp.float32)
        present = jax.ops.segment_sum(valid.reshape(-1), episode.reshape(-1), num) > 0
        return cls(episode, present.astype(jnp.float32), num)

    def sum(self, x):
        """``[R, T] -> [E]``: each episode's sum of a per-token array."""
        if self.episode is None:
            return x.sum(-1)
        return jax.ops.segment_sum(x.reshape(-1), self.episode.reshape(-1), self.num)

    def spread(self, v):
        """``[E] ->`` each token's episode's value (``[R, T]``; row layout: ``[B, 1]``, broadcasting)."""
        return v[:, None] if self.episode is None else v[self.episode]


def aggregation_weights(
    loss_mask,
    subgroup=None,
    loss_agg: str = "token_mean",
    subgroup_mean: bool = False,
    episodes: Episodes | None = None,
):
    """Per-token weights ``w [B, T]`` such that the aggregated loss is ``Σ_bt w_bt ℓ_bt`` (full batch).

    * ``token_mean``: ``w = m / Σ m`` (within the cell).
    * ``seq_mean_token_mean``: ``w = m / (|τ_b| · #rows)`` (rows with at least one token).
    * ``subgroup_mean``: cells = subgroups; the cell aggregates are averaged over the *non-empty* cells,
      i.e. J = ½ Σ_c J_c with both subgroups present, J = J_0 for the all-free baseline.

    Args:
      loss_mask: ``[B, T]`` {0, 1}.
      subgroup: ``[B]`` int (needed when ``subgroup_mean``); ``[E]`` per episode for a packed batch.
      episodes: the packed batch's :class:`Episodes` (None: one episode per row).
    Returns:
      ``[B, T]`` float32, summing to 1 (or 0 for an empty mask).
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    m = jnp.asarray(loss_mask, jnp.float32)
    if episodes is None:
        episodes = Episodes(None, jnp.ones(m.shape[:1], jnp.float32), m.shape[0])
    lengths = episodes.sum(m)  # [E]: the sequence lengths, whatever the layout
    if subgroup_mean:
        if subgroup is None:
            raise ValueError("subgroup_mean=True needs the batch key 'subgroup'")
        cells = jnp.asarray(subgroup, jnp.int32)
        num_cells = NUM_SUBGROUPS
    else:
        cells = jnp.zeros(lengths.shape, jnp.int32)
        num_cells = 1
    row_w = jnp.zeros_like(lengths)
    present = jnp.zeros((), jnp.float32)
    for c in range(num_cells):
        in_c = (cells == c) & (lengths > 0)
        if loss_agg == "token_mean":
            den = jnp.sum(jnp.where(in_c, lengths, 0.0))
            w_c = 1.0 / jnp.maximum(den, 1.0)
        else:
            den = jnp.sum(in_c.astype(jnp.float32))
            w_c = 1.0 / (jnp.maximum(den, 1.0) * jnp.maximum(lengths, 1.0))
        row_w = row_w + jnp.where(in_c, w_c, 0.0)
        present = present + (den > 0)
    return m * episodes.spread(row_w / jnp.maximum(present, 1.0))


def _masked_pair(x, m):
    return jnp.sum(x * m), jnp.sum(m)


def _log_ratio(logp, old_logp, m, mode: str, episodes: Episodes | None = None):
    """log ρ per token: per-token, or the episode's length-normalised sequence log-ratio broadcast to its tokens
    (``episodes``: a packed batch's map; None: one episode per row)."""
    lr = (logp - old_logp) * m
    if mode == "token":
        return lr
    if episodes is None:
        episodes = Episodes(None, jnp.ones(m.shape[:1], jnp.float32), m.shape[0])
    seq = episodes.sum(lr) / jnp.maximum(episodes.sum(m), 1.0)
    return episodes.spread(seq) * m


def ppo_clip_token_loss(ratio, adv, clip_eps: float):
    """Per-token PPO-clip loss ``-min(ρ A, clip(ρ, 1-ε, 1+ε) A)`` and whether the clipped branch is active.

    Args:
      ratio: ``[B, T]``; adv: broadcastable (``[B, 1]``).
    Returns:
      ``(loss [B, T], clipped [B, T] float)``; "clipped" = the clip removes the gradient.
    """
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    return -jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32)


def actor_loss(logp, entropy, batch, cfg: ActorLossConfig):
    """Subgroup PPO-clip loss (to minimise) and metrics for one (micro-)batch.

    Args:
      logp: ``[B, T]`` current-policy token logprobs (:func:`token_logprobs`).
      entropy: ``[B, T]`` or None.
      batch: the layout above, plus ``token_weight`` ``[B, T]`` from :func:`aggregation_weights` over the
        full batch (the update step adds it; standalone callers may omit it for a single full batch).
    Returns:
      ``(loss scalar, metrics: dict[str, (num, den)])``.
    """
    m = jnp.asarray(batch["loss_mask"], jnp.float32)
    eps = Episodes.of(batch, m)
    sg = jnp.asarray(per_episode(batch, "subgroup"), jnp.int32)
    sft = jnp.asarray(per_episode(batch, "sft_row"), jnp.float32) if cfg.sft_coef > 0 else jnp.zeros(eps.num)
    m_pg = m * eps.spread(1.0 - sft)
    if TOKEN_WEIGHT not in batch:
        batch = {**batch, **actor_token_weights(batch, cfg)}
    w = batch[TOKEN_WEIGHT]
    adv = jnp.asarray(per_episode(batch, "advantages"), jnp.float32)  # [E]
    log_ratio = _log_ratio(logp, batch["old_logprobs"], m_pg, cfg.ratio, eps)
    ratio = jnp.exp(log_ratio)
    tok_loss, clipped = ppo_clip_token_loss(ratio, eps.spread(adv), cfg.clip_eps)
    pg_loss = jnp.sum(w * tok_loss)
    metrics = {"pg_loss": (pg_loss, jnp.sum(w))}
    loss = pg_loss
    if cfg.sft_coef > 0:
        m_sft = m * eps.spread(sft)
        sft_loss = -jnp.sum(batch[SFT_WEIGHT] * logp)
        loss = loss + cfg.sft_coef * sft_loss
        metrics["sft_nll"] = _masked_pair(-logp, m_sft)
    metrics.update(_policy_metrics(log_ratio, clipped, entropy, m_pg))
    lengths = eps.sum(m_pg)  # [E]
    for c, name in enumerate(SUBGROUP_NAMES):
        in_c = ((sg == c) & (sft == 0)).astype(jnp.float32)  # [E]
        here = in_c * eps.present  # per-episode metrics: counted in the micro-batch that holds the episode
        metrics[f"clipfrac_{name}"] = _masked_pair(clipped, m_pg * eps.spread(in_c))
        metrics[f"adv_mean_{name}"] = _masked_pair(adv, here)
        metrics[f"adv_sq_{name}"] = _masked_pair(adv**2, here)
        metrics[f"tokens_{name}"] = _masked_pair(lengths, here)
    return loss, metrics


def actor_token_weights(batch, cfg: ActorLossConfig):
    """Full-batch weights for the actor: ``{token_weight: [B, T]}`` for the PPO term (SFT rows excluded) and,
    with ``sft_coef > 0``, ``{sft_weight: [B, T]}`` (token mean over the SFT rows)."""
    m = jnp.asarray(batch["loss_mask"], jnp.float32)
    eps = Episodes.of(batch, m)
    sub = per_episode(batch, "subgroup")
    if cfg.sft_coef <= 0:
        return {TOKEN_WEIGHT: aggregation_weights(m, sub, cfg.loss_agg, cfg.subgroup_mean, eps)}
    sft = eps.spread(jnp.asarray(per_episode(batch, "sft_row"), jnp.float32))
    m_sft = m * sft
    return {
        TOKEN_WEIGHT: aggregation_weights(m * (1.0 - sft), sub, cfg.loss_agg, cfg.subgroup_mean, eps),
        SFT_WEIGHT: m_sft / jnp.maximum(m_sft.sum(), 1.0),
    }


def extractor_token_weights(batch, cfg: ExtractorLossConfig):
    """Full-batch weights for the extractor (one cell: all samples): ``{token_weight: [B, T]}``."""
    m = jnp.asarray(batch["loss_mask"], jnp.float32)
    return {TOKEN_WEIGHT: aggregation_weights(m, None, cfg.loss_agg, False, Episodes.of(batch, m))}


def cispo_token_loss(logp, old_logp, adv, clip_eps: float, mask=None):
    """Per-token CISPO loss ``-sg(clip(ρ, 1-ε, 1+ε)) · A · log π`` and whether ρ was clipped.

    Unlike PPO-clip the gradient never vanishes: clipping only bounds the (stop-gradient) IS weight, so
    ``∂ℓ/∂log π = -clip(ρ) · A`` for every token. ``mask`` (``[B, T]``) pins ρ = 1 on tokens outside the loss,
    whose ``old_logp`` is 0 by convention.
    """
    log_ratio = logp - old_logp if mask is None else (logp - old_logp) * mask
    ratio = jnp.exp(log_ratio)
    is_w = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps))
    was_clipped = (jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)
    return -is_w * adv * logp, was_clipped, is_w


def extractor_loss(logp, entropy, batch, cfg: ExtractorLossConfig):
    """CISPO loss with Eq. 7-weighted batch-mean advantages; same contract as :func:`actor_loss`.

    The effective advantage is ``batch["advantages"] * batch["sample_weight"]``: pass the *unweighted*
    ``r - mean(r)`` (:func:`~.advantages.extractor_advantages`) together with the weights, or already-weighted
    advantages with ``sample_weight = 1`` -- never both, or the weights are applied twice.
    """
    m = jnp.asarray(batch["loss_mask"], jnp.float32)
    eps = Episodes.of(batch, m)
    if TOKEN_WEIGHT not in batch:
        batch = {**batch, **extractor_token_weights(batch, cfg)}
    w = batch[TOKEN_WEIGHT]
    raw_adv = jnp.asarray(per_episode(batch, "advantages"), jnp.float32)  # [E]
    sw = jnp.asarray(per_episode(batch, "sample_weight"), jnp.float32)
    adv = eps.spread(raw_adv * sw)
    tok_loss, was_clipped, is_w = cispo_token_loss(logp, batch["old_logprobs"], adv, cfg.clip_eps, m)
    loss = jnp.sum(w * tok_loss)
    rows = eps.present  # per-sample metrics: counted in the micro-batch that holds the sample
    metrics = {
        "cispo_loss": (loss, jnp.sum(w)),
        "is_weight": _masked_pair(is_w, m),
        "is_weight_max": (jnp.max(jnp.where(m > 0, is_w, 0.0)), jnp.max(m)),
        "adv_mean": _masked_pair(raw_adv, rows),
        "adv_sq": _masked_pair(raw_adv**2, rows),
        "weighted_frac": _masked_pair((sw > 0).astype(jnp.float32), rows),
        "sample_weight": _masked_pair(sw, rows),
    }
    metrics.update(_policy_metrics((logp - batch["old_logprobs"]) * m, was_clipped, entropy, m))
    return loss, metrics


def _policy_metrics(log_ratio, clipped, entropy, m):
    # k3 estimator of KL(π_old || π): (ρ - 1) - log ρ >= 0, unbiased under samples from π_old.
    k3 = jnp.exp(log_ratio) - 1.0 - log_ratio
    ratio = jnp.exp(log_ratio)
    out = {
        "clipfrac": _masked_pair(clipped, m),
        "approx_kl": _masked_pair(k3, m),
        "ratio": _masked_pair(ratio, m),
        # A max, not a sum: micro-batch accumulation takes the maximum of "*_max" pairs (den = any token).
        "ratio_max": (jnp.max(jnp.where(m > 0, ratio, 0.0)), jnp.max(m)),
    }
    if entropy is not None:
        out["entropy"] = _masked_pair(entropy, m)
    return out


def is_max_metric(name: str) -> bool:
    """Metric pairs accumulated over micro-batches with ``max`` instead of a sum."""
    return name.endswith("_max")


def accumulate_pairs(acc, pairs):
    """Adds one micro-batch's ``{name: (num, den)}`` to ``acc`` (float32): sums, or the max for ``*_max``."""
    out = {}
    for k, v in pairs.items():
        op = jnp.maximum if is_max_metric(k) else jnp.add
        out[k] = tuple(op(a, b.astype(jnp.float32)) for a, b in zip(acc[k], v, strict=True))
    return out


def finalize_metrics(pairs):
    """``{name: (num, den)}`` -> ``{name: num / den}`` (NaN where den = 0, e.g. an absent subgroup), plus
    ``adv_std*`` from the ``adv_sq*`` / ``adv_mean*`` pairs (population std over rows)."""
    out = {k: jnp.where(d > 0, n / jnp.where(d > 0, d, 1.0), jnp.nan) for k, (n, d) in pairs.items()}
    for k in list(out):
        if k.startswith("adv_sq"):
            mean = out[k.replace("adv_sq", "adv_mean")]
            out[k.replace("adv_sq", "adv_std")] = jnp.sqrt(jnp.maximum(out.pop(k) - mean**2, 0.0))
    return out


# The loss a config selects: its type -> (loss_fn(logp, entropy, batch, cfg), token_weights_fn(batch, cfg)).
# A new loss = a frozen config dataclass + its two functions, registered with register_loss.
LOSSES: dict[type, tuple[Callable, Callable]] = {
    ActorLossConfig: (actor_loss, actor_token_weights),
    ExtractorLossConfig: (extractor_loss, extractor_token_weights),
}


def register_loss(config_type: type, loss_fn: Callable, token_weights_fn: Callable) -> None:
    """Makes ``config_type`` instances select ``loss_fn`` / ``token_weights_fn`` in the update step."""
    LOSSES[config_type] = (loss_fn, token_weights_fn)


def loss_functions(cfg) -> tuple[Callable, Callable]:
    """``(loss_fn, token_weights_fn)`` of a loss config (:data:`LOSSES`)."""
    try:
        return LOSSES[type(cfg)]
    except KeyError:
        names = ", ".join(t.__name__ for t in LOSSES)
        raise TypeError(
            f"no loss registered for {type(cfg).__name__}; use one of {names} or rl.losses.register_loss"
        ) from None
