"""Supervised warm start: next-token cross-entropy on the answer tokens of (prompt, answer) rows, and the folder
writer (Hugging Face layout: ``config.json`` + ``model.safetensors`` + ``tokenizer.json``).

Rows are grouped by length (buckets of 16 tokens) so a batch pads little, and the head scores only the answer
positions (the prompt is context, never a target): the actor's answer is 4 tokens of ~70, the extractor's ~10.
Optimiser: AdamW, linear warm-up then cosine decay, global-norm clipping at 1.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from comprl_jax.models import decoder as dec
from comprl_jax.models.config import ModelConfig
from comprl_jax.models.hf_io import save_hf

BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Attributes: steps / batch; lr (peak), warmup (steps), final_lr_frac (cosine floor as a fraction of lr);
    max_answer: answer positions scored per row (longer answers are cut); seed: init and batch order."""

    steps: int = 2000
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 100
    final_lr_frac: float = 0.05
    weight_decay: float = 0.01
    max_answer: int = 40
    lm_weight: float = 0.0
    seed: int = 0


def model_config(
    vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, ff: int, head_dim: int = 0
) -> ModelConfig:
    """A small Qwen3 decoder (tied embeddings, per-head q/k norms), float32; ``head_dim`` 0: ``hidden // heads``."""
    return ModelConfig(
        arch="qwen3",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ff,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def pack(
    rows: Sequence[tuple[list[int], list[int]]], pad: int, max_answer: int, length: int = 0, size: int = 0
):
    """Rows -> ``(tokens [B, T], valid [B, T], at [B, A], want [B, A], scored [B, A])``: ``at`` the positions whose
    logits predict the answer tokens ``want`` (``scored`` weighs them: 1 each, or a row's third element, one weight
    per answer token; 0 for padding). ``T`` is the longest row rounded up to
    :data:`BUCKET` (or ``length``); ``B`` is ``len(rows)`` (or ``size``: padding rows score nothing), so a probe
    compiles one shape."""
    T = max(max(len(r[0]) + len(r[1]) for r in rows), length)
    T = -(-T // BUCKET) * BUCKET
    B = max(len(rows), size)
    tokens = np.full((B, T), pad, np.int32)
    valid = np.zeros((B, T), bool)
    at = np.zeros((B, max_answer), np.int32)
    want = np.zeros((B, max_answer), np.int32)
    scored = np.zeros((B, max_answer), np.float32)
    for b, r in enumerate(rows):
        p, a = r[0], r[1]
        row = list(p) + list(a)
        tokens[b, : len(row)] = row
        valid[b, : len(row)] = True
        n = min(len(a), max_answer)
        at[b, :n] = np.arange(len(p) - 1, len(p) - 1 + n)
        want[b, :n] = a[:n]
        scored[b, :n] = r[2][:n] if len(r) > 2 else 1.0
    return tokens, valid, at, want, scored


def answer_logits(graphdef, params, tokens, valid, at):
    """Logits ``[B, A, V]`` at the answer positions ``at``."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden = dec.forward(graphdef, params, tokens, positions, valid, return_hidden=True)
    h = jnp.take_along_axis(hidden, at[..., None], axis=1)
    return dec.logits_from_hidden(graphdef, params, h)


def loss_fn(graphdef, params, tokens, valid, at, want, scored, lm_weight: float = 0.0):
    """Cross-entropy over the answer tokens, averaged with the weights ``scored`` (plus ``lm_weight`` x the mean
    next-token cross-entropy over the whole row, prompt included); also the answer-token accuracy (same weights)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden = dec.forward(graphdef, params, tokens, positions, valid, return_hidden=True)
    h = jnp.take_along_axis(hidden, at[..., None], axis=1)
    logits = dec.logits_from_hidden(graphdef, params, h)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, want[..., None], axis=-1)[..., 0]
    n = jnp.maximum(scored.sum(), 1.0)
    acc = ((jnp.argmax(logits, -1) == want) * scored).sum() / n
    loss = (nll * scored).sum() / n
    if lm_weight:
        # the prompt as text: repeated names and verbs in it are what copying is learnt from
        all_logp = jax.nn.log_softmax(dec.logits_from_hidden(graphdef, params, hidden[:, :-1]), axis=-1)
        tok_nll = -jnp.take_along_axis(all_logp, tokens[:, 1:, None], axis=-1)[..., 0]
        m = valid[:, 1:].astype(jnp.float32)
        loss = loss + lm_weight * (tok_nll * m).sum() / jnp.maximum(m.sum(), 1.0)
    return loss, acc


def optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), cfg.lr * cfg.final_lr_frac
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=cfg.weight_decay))


def make_step(graphdef, opt: optax.GradientTransformation, lm_weight: float = 0.0):
    @jax.jit
    def step(params, opt_state, tokens, valid, at, want, scored):
        (loss, acc), grads = jax.value_and_grad(
            lambda p: loss_fn(graphdef, p, tokens, valid, at, want, scored, lm_weight), has_aux=True
        )(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    return step


def batches(n_rows: int, lengths: Sequence[int], batch: int, rng: np.random.Generator):
    """An endless stream of index batches of rows of similar length (shuffled within and across buckets)."""
    lengths = np.asarray(lengths)
    while True:
        order = rng.permutation(n_rows)
        # sort a shuffled order by bucket: equal-bucket rows stay in random order
        order = order[np.argsort(lengths[order] // BUCKET, kind="stable")]
        chunks = [order[i : i + batch] for i in range(0, n_rows - batch + 1, batch)]
        for j in rng.permutation(len(chunks)):
            yield chunks[j]


def train(
    cfg: SFTConfig,
    model: ModelConfig,
    rows: Sequence[tuple[list[int], list[int]]],
    pad: int,
    *,
    log: Callable[[dict], None] = print,
    every: int = 100,
    on_eval: Callable[[int, object], dict] | None = None,
    params=None,
    curriculum: Sequence[tuple[Sequence[tuple[list[int], list[int]]], int]] = (),
):
    """Trains from random init (or ``params``) on ``rows``; returns ``(graphdef, params)``.

    ``on_eval(step, params)``: called every ``every`` steps and at the end; what it returns is logged with the
    step's mean loss and answer-token accuracy. ``curriculum``: ``(rows, steps)`` phases that come first, each
    drawing its batches from its own rows (``cfg.steps`` counts them too)."""
    graphdef, init = dec.init_decoder(model, seed=cfg.seed)
    params = init if params is None else params
    opt = optimizer(cfg)
    opt_state = opt.init(params)
    step_fn = make_step(graphdef, opt, cfg.lm_weight)
    rng = np.random.default_rng(cfg.seed)
    plan = [(r, n) for r, n in curriculum if n > 0] + [(rows, cfg.steps)]
    streams = [batches(len(r), [len(x[0]) + len(x[1]) for x in r], cfg.batch, rng) for r, _ in plan]
    ends = np.cumsum([n for _, n in plan])
    losses, accs = [], []
    for s in range(1, cfg.steps + 1):
        phase = int(np.searchsorted(ends, s - 1, side="right"))
        src = plan[phase][0]
        arrays = pack([src[i] for i in next(streams[phase])], pad, cfg.max_answer)
        params, opt_state, loss, acc = step_fn(params, opt_state, *arrays)
        losses.append(loss)
        accs.append(acc)
        if s % every == 0 or s == cfg.steps:
            row = {
                "step": s,
                "loss": float(np.mean(jax.device_get(losses))),
                "acc": float(np.mean(jax.device_get(accs))),
            }
            losses, accs = [], []
            if on_eval is not None:
                row.update(on_eval(s, params))
            log(row)
    return graphdef, params


def save_folder(
    folder: str, model: ModelConfig, params, tokenizer_json: str, dtype: str = "bfloat16"
) -> None:
    """The Hugging Face folder of a trained model: weights (``dtype``), ``config.json``, ``tokenizer.json``.
    Written beside and renamed into place, so a reader never sees half a folder."""
    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(tmp, model, params, dtype=dtype)
    shutil.copyfile(tokenizer_json, os.path.join(tmp, "tokenizer.json"))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
