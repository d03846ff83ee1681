"""Host-side training batches of both roles, built from exactly what the samplers produced (SPEC §2-3, §7).

Actor (:func:`actor_batch`): one row per trajectory, the sampled ids with the assistant mask and the sampler's
log-probabilities; rows of episodes that failed for infrastructure reasons are masked out entirely (advantage 0
*and* no tokens, so they do not dilute the token mean either). With self-distillation (SPEC §7) a fixed number of
extra rows holds the selected guided trajectories re-encoded with the experience stripped from their system
message (``sft_row = 1``).

Extractor (:func:`extractor_batch`): one row per buffer sample, prompt ids + sampled response ids from its token
record (so the update trains on exactly the prompt the sampler consumed, truncation included), the behaviour
log-probabilities of the extractor version that wrote it, and the Eq. 7 weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from comprl_jax.experience.sample import decode_record
from comprl_jax.rl import extractor_advantages
from comprl_jax.roles import batching
from comprl_jax.roles.role import BEHAVIOUR_MASK, SAMPLED_BY, USE_BEHAVIOUR
from comprl_jax.rollout.episodes import Trajectory, system_message


def shift_free(mask: Sequence[int]) -> list[int]:
    """Token 0 has no prediction: never in the loss."""
    return [0] + list(mask[1:]) if len(mask) else list(mask)


def strip_experience(
    traj: Trajectory, tokenizer, base_prompt: str, tool: str = ""
) -> tuple[list[int], list[int]] | None:
    """``traj``'s ids and assistant mask with all experience taken out (SPEC §7 self-distillation): the experience
    block and the search & ask tool description (``tool``, as the episode's system message had it) leave the system
    message, and every search & ask exchange (the question turn and the extractor's answer, up to the next reply)
    leaves the turns; the other turns are kept id for id. None when the rendered system message is not a prefix of
    the ids."""
    with_exp = system_message(base_prompt, traj.spec.experience, tool)
    plain = system_message(base_prompt, "", "")
    head, _ = tokenizer.apply_chat_template([{"role": "system", "content": with_exp}])
    new, _ = tokenizer.apply_chat_template([{"role": "system", "content": plain}])
    if traj.tokens[: len(head)] != head:
        return None
    keep = np.ones(len(traj.tokens), bool)
    keep[: len(head)] = False
    for a, b in traj.ask_spans:
        keep[a:b] = False
    ids = [t for t, k in zip(traj.tokens, keep, strict=True) if k]
    mask = [m for m, k in zip(traj.loss_mask, keep, strict=True) if k]
    return new + ids, [0] * len(new) + mask


def actor_batch(
    trajs: Sequence[Trajectory],
    advantages: np.ndarray,
    subgroup: np.ndarray,
    pad_id: int,
    sft: Sequence[tuple[list[int], list[int]]] = (),
    sft_slots: int = 0,
    sampled_by: int | None = None,
) -> dict[str, np.ndarray]:
    """The actor's update batch.

    Args:
      trajs: the step's trajectories (rows, in order).
      advantages / subgroup: ``[len(trajs)]`` (subgroup: 1 = guided).
      sft: self-distillation rows ``(ids, mask)`` (at most ``sft_slots``).
      sft_slots: extra rows reserved for SFT (fixed per run so the update compiles once); unused ones are empty.
      sampled_by: the actor's ``Role.version`` whose sampler played ``trajs`` (``roles.SAMPLED_BY``).
    Returns:
      the loss batch layout (:mod:`comprl_jax.rl.losses`) with ``sft_row`` when ``sft_slots``, plus the behaviour
      keys of :mod:`comprl_jax.roles.role`.
    """
    if len(sft) > sft_slots:
        raise ValueError(f"{len(sft)} self-distillation rows for {sft_slots} slots")
    seqs = [t.tokens for t in trajs] + [ids for ids, _ in sft]
    masks = [[0] * len(t.tokens) if t.infra_failed else shift_free(t.loss_mask) for t in trajs]
    masks += [shift_free(m) for _, m in sft]
    lps = [t.logprobs for t in trajs] + [[0.0] * len(ids) for ids, _ in sft]
    rows = len(trajs) + sft_slots
    batch = batching.pack(seqs, masks, pad_id, rows=rows, logprobs=lps)
    batch.pop("row_valid")
    adv = np.zeros((rows,), np.float32)
    adv[: len(trajs)] = np.where([t.infra_failed for t in trajs], 0.0, advantages)
    sub = np.ones((rows,), np.int32)
    sub[: len(trajs)] = subgroup
    batch["advantages"] = adv
    batch["subgroup"] = sub
    is_sft = np.zeros((rows,), np.float32)
    is_sft[len(trajs) :] = 1.0
    if sft_slots:
        batch["sft_row"] = is_sft
    batch[BEHAVIOUR_MASK] = batch["loss_mask"] * (1.0 - is_sft)[:, None]
    if sampled_by is not None:
        batch[SAMPLED_BY] = sampled_by
    return batch


def extractor_batch(xb, tokenizer, version: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The extractor's update batch for one popped buffer batch, and its host metrics.

    Samples with a token record train on its exact ids against its behaviour logprobs; a sample without one (a
    text-only extractor_fn) is re-encoded from its text and its old logprobs are recomputed (ratio 1).
    """
    seqs, masks, lps, use, stale = [], [], [], [], []
    for prompt, response, rec in zip(xb.prompts, xb.responses, xb.tokens, strict=True):
        if rec is not None:
            s = decode_record(rec)
            seqs.append(s.ids)
            masks.append(shift_free(s.mask))
            lps.append(s.logprobs)
            use.append(True)
            stale.append(version - s.version)
            continue
        ids = tokenizer.encode_user_prompt(prompt)
        resp = tokenizer.encode(response)
        seqs.append(ids + resp)
        masks.append(shift_free([0] * len(ids) + [1] * len(resp)))
        lps.append([0.0] * (len(ids) + len(resp)))
        use.append(False)
    batch = batching.pack(seqs, masks, tokenizer.pad_id, logprobs=lps)
    batch.pop("row_valid")
    use_arr = np.asarray(use, bool)
    # Unweighted r - mean; the loss applies the Eq. 7 weights through sample_weight (once).
    batch["advantages"] = np.asarray(extractor_advantages(xb.rewards), np.float32)
    batch["sample_weight"] = np.asarray(xb.weights, np.float32)
    batch[USE_BEHAVIOUR] = use_arr
    batch[BEHAVIOUR_MASK] = batch["loss_mask"] * use_arr[:, None]
    metrics = {
        "reward_mean": float(np.mean(xb.rewards)),
        "zero_weight_samples": float(np.sum(np.asarray(xb.weights) == 0)),
        "behaviour_rows": float(use_arr.mean()),
    }
    if stale:
        metrics["staleness_mean"] = float(np.mean(stale))
        metrics["staleness_max"] = float(np.max(stale))
    return batch, metrics
