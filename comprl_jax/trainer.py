"""The Complementary RL loop (SPEC §6) with every baseline of §8, exact resume, metrics and evaluation.

Step s (sections below follow this order):
  1. tasks      draw tasks x K rollouts; K/2 guided (retrieved entry in the system prompt), K/2 free.
  2. rollout    play all episodes (env pools <-> actor sampler), token in / token out.
  3. advantages subgroup-normalised (guided vs free) outcome advantages.
  4. extractor  record entry rewards; start distilling this step's trajectories in the background thread.
  5. actor      old logprobs + one PPO-clip update (overlaps the extractor's generation via async dispatch).
  6. bank       apply the distilled ops in trajectory order; merge every ``bank.merge_every`` steps;
                an extractor CISPO update whenever the buffer holds ``extractor.buffer_size`` samples.
  7. log / checkpoint.
All bank mutations happen at fixed points of the step in a fixed order, so a resumed run is bit-identical.

Devices (``mesh`` config, :mod:`comprl_jax.distributed`): one device -> no mesh; otherwise each role gets a
``(data, fsdp, tensor)`` mesh, shared (``colocated``) or on disjoint devices (``disjoint``: the extractor's update is
dispatched at the end of step s and joined after step s+1's rollout, so the two run at the same time; its metrics
still land in row s). Several processes: replicated host state over SPMD device state (see distributed.py).

Baselines: ``baseline`` (no experience, all K free, no extractor), ``static_online`` (extractor never updated),
``exp_only`` (actor frozen), ``offline`` (bank built by the frozen extractor during ``actor.warmup_steps``
with a frozen actor, then fixed).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from typing import Any

import jax
import numpy as np

from comprl_jax import batching
from comprl_jax import distributed as dist
from comprl_jax import metrics as mlib
from comprl_jax import sharding as shd
from comprl_jax.checkpoint import RunCheckpointer
from comprl_jax.experience.retrieval import format_experience
from comprl_jax.extractor_track import ExtractorTrack
from comprl_jax.model_zoo import LoadedModel, load_model, tiny_tokenizer
from comprl_jax.models import decoder
from comprl_jax.rl import (
    ActorLossConfig,
    ExtractorLossConfig,
    OptimConfig,
    create_train_state,
    extractor_advantages,
    make_logprob_fn,
    make_optimizer,
    make_update_fn,
    subgroup_advantages,
    train_state_shardings,
)
from comprl_jax.rl.update import ChunkedHead
from comprl_jax.rollout import EpisodeSpec, Pools, outcome, reset_all, run_episodes
from comprl_jax.sampling import SamplerService, SamplingParams, vocab_bytes
from comprl_jax.tasks import TaskSampler

log = logging.getLogger(__name__)


def _sp(s) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        greedy=s.greedy,
    )


@dataclasses.dataclass
class Role:
    """One trained LLM (actor or extractor): model, train state, jitted functions, sampler."""

    model: LoadedModel
    state: Any
    update: Any
    logprobs: Any
    sampler: SamplerService
    mesh: Any = None  # the role's device mesh (None: one device, unsharded)


def _scorer(graphdef, remat: bool, logits_chunk: int):
    """The model as the updates see it: plain logits, or trunk + output head scored ``logits_chunk`` positions
    at a time (:class:`~comprl_jax.rl.update.ChunkedHead`); ``remat`` recomputes each layer in the backward."""
    if not logits_chunk:
        return functools.partial(decoder.forward, graphdef, remat=remat)
    return ChunkedHead(
        functools.partial(decoder.forward, graphdef, return_hidden=True, remat=remat),
        functools.partial(decoder.logits_from_hidden, graphdef),
        logits_chunk,
    )


def _role(model: LoadedModel, kind: str, c, loss_cfg, batch_rows: int, mesh=None) -> Role:
    """``batch_rows``: rows of every update batch of this role (fixed: one rollout batch / one buffer pop)."""
    if batch_rows % c.micro_batch:
        raise ValueError(
            f"config key {kind}.micro_batch={c.micro_batch} must divide the {kind} batch of {batch_rows} rows"
        )
    nb = dist.batch_devices(mesh)
    if c.micro_batch % nb:
        raise ValueError(
            f"config key {kind}.micro_batch={c.micro_batch} must be a multiple of the {nb} devices the {kind} "
            f"batch is split over (mesh.data x mesh.fsdp of its mesh {dict(mesh.shape)}); raise "
            f"{kind}.micro_batch, or put devices on mesh.tensor / use fewer with mesh.num_devices"
        )
    m = batch_rows // c.micro_batch
    tx = make_optimizer(OptimConfig(lr=c.lr, weight_decay=c.weight_decay, grad_clip=c.grad_clip))
    state = create_train_state(model.params, tx, mesh)
    logits_fn = _scorer(model.graphdef, c.remat, c.logits_chunk)
    shardings = None if mesh is None else train_state_shardings(state, mesh)
    update = make_update_fn(
        logits_fn, kind, loss_cfg, tx, num_micro_batches=m, mesh=mesh, state_shardings=shardings
    )
    logprobs = make_logprob_fn(
        logits_fn,
        num_micro_batches=m,
        mesh=mesh,
        param_shardings=None if shardings is None else shardings.params,
    )
    tok = model.tokenizer
    stop_ids = [i for i in (tok.eos_id, tok.special_ids.get("<|im_end|>")) if i is not None]
    sampler = (SamplerService if mesh is None else dist.mesh_sampler_cls())(
        model.graphdef,
        state.params,
        model.cfg,
        vocab=vocab_bytes(tok, model.cfg.vocab_size),
        stop_token_ids=stop_ids,
        pad_id=tok.pad_id,
        mesh=mesh,
    )
    return Role(model, state, update, logprobs, sampler, mesh)


def _dispatch_update(role: Role, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Old logprobs with the pre-update params, then one optimizer step; params pushed to the sampler.
    Returns the metrics as device arrays: nothing here waits for the device (async dispatch)."""
    if role.mesh is None:
        batch = {k: jax.numpy.asarray(v) for k, v in batch.items()}
    else:  # the one host->device transfer; each process feeds the rows its devices hold
        batch = shd.put_batch(batch, role.mesh)
    batch["old_logprobs"] = role.logprobs(role.state.params, batch)
    role.state, m = role.update(role.state, batch)
    role.sampler.update_params(role.state.params)
    return m


def _train_role(role: Role, batch: dict[str, np.ndarray]) -> dict[str, float]:
    return jax.device_get(_dispatch_update(role, batch))


class Trainer:
    def __init__(self, config, workdir: str):
        self.c = c = config
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.experience = c.method != "baseline"
        self.train_actor = c.method != "exp_only"
        self.train_extractor = (
            self.experience and c.extractor.update and c.method not in ("static_online", "offline")
        )
        self.tasks = TaskSampler(c.env.tasks, c.rollout.tasks_per_step, c.seed)
        slots = c.rollout.tasks_per_step * c.rollout.group_size
        self.pools = Pools(
            c.env.tasks, slots, c.env.workers, c.env.backend, c.env.max_turns, c.env.step_timeout_s
        )
        # Device meshes (None, None on one device). Multi-process: host state is replicated, see distributed.py.
        self.actor_mesh, self.extractor_mesh = dist.build_meshes(c.mesh)
        self.multi = dist.multi()
        self.leader = dist.is_leader()
        self.overlap_extractor = (
            self.actor_mesh is not None
            and c.mesh.placement == "disjoint"
            and not c.retrieval.search_and_ask  # search & ask samples the extractor during rollouts
        )
        self._xpending: tuple | None = (
            None  # an extractor update in flight: (metrics row, device metrics, t0)
        )
        self.timeline: list[dict] = []
        tok = None
        if "tiny" in (c.actor.model, c.extractor.model):
            tok_dir = os.path.join(workdir, "tokenizer")
            # One process trains the vocabulary; the others load it (the run directory is shared).
            if self.leader:
                tok = tiny_tokenizer(self._corpus(), tok_dir)
            dist.barrier("tiny_tokenizer")
            if not self.leader:
                tok = tiny_tokenizer([], tok_dir)
        self.actor = _role(
            load_model(c.actor.model, role="actor", tokenizer=tok, seed=c.seed, mesh=self.actor_mesh),
            "actor",
            c.actor,
            ActorLossConfig(
                clip_eps=c.actor.clip_eps,
                ratio=c.actor.ratio,
                loss_agg=c.actor.loss_agg,
                subgroup_mean=c.actor.subgroup_mean,
            ),
            slots * len(c.env.tasks),
            self.actor_mesh,
        )
        self.extractor = None
        self.track = None
        if self.experience:
            self.extractor = _role(
                load_model(
                    c.extractor.model,
                    role="extractor",
                    tokenizer=tok,
                    seed=c.seed + 1,
                    mesh=self.extractor_mesh,
                ),
                "extractor",
                c.extractor,
                ExtractorLossConfig(clip_eps=c.extractor.cispo_eps, loss_agg=c.extractor.loss_agg),
                c.extractor.buffer_size,
                self.extractor_mesh,
            )
            from comprl_jax.models.embedders import get_embedder

            self.track = ExtractorTrack(
                c,
                get_embedder(c.retrieval.embedder),
                self.extractor.sampler,
                self.extractor.model.tokenizer,
                c.seed,
            )
        self.actor_sp = _sp(c.actor.sampling)
        self._constraints: dict[str, Any] = {}
        self.step = 0
        self.key = jax.random.key(c.seed)
        self.ckpt = RunCheckpointer(
            os.path.join(workdir, "checkpoints"), c.checkpoint.every, c.checkpoint.max_to_keep
        )

    # -- set-up helpers ------------------------------------------------------------------------------
    def _corpus(self) -> list[str]:
        """Text the tiny tokenizer is trained on: system prompts, a few real first observations per env, and
        the extractor's prompt templates and op format."""
        from comprl_jax.experience import ops as xops

        text = list(self.pools.system_prompts.values())
        for pool in self.pools.pools.values():
            for seed in range(3):
                obs, info = pool.submit_reset(0, seed).result()
                text.append(f"Observation: {obs}")
                text.append(str(info.get("goal", "")))
        text += [
            xops.distill_prompt(
                "goal", True, "Observation: x\nAction: y", ["<title>a</title><content>b</content>"], 10
            ),
            xops.merge_prompt(["<title>a</title><content>b</content>"], 10),
        ]
        text += [
            "Observation: ",
            '[{"function_name": "add", "parameters": {"new_memory": "',
            '{"function_name": "return"}',
        ]
        lesson = "<title>move east</title><content>the stairs are often east</content>"
        text += [format_experience([lesson]), format_experience([])]
        return text

    def _constraint(self, env_id: str):
        if not self.c.actor.constrained:
            return None
        if env_id not in self._constraints:
            actions, regex = self.pools.action_spaces[env_id]
            if actions:  # a static action set (MiniHack, Sokoban)
                c = self.actor.sampler.strings_constraint(tuple(f"<answer>{a}</answer>" for a in actions))
            elif regex:  # else the action syntax (ALFWorld, WebShop)
                c = self.actor.sampler.regex_constraint(regex)
            else:
                raise ValueError(
                    f"actor.constrained needs {env_id} to expose env.actions or env.action_regex"
                )
            self._constraints[env_id] = c
        return self._constraints[env_id]

    # -- state -----------------------------------------------------------------------------------------
    def _train_tree(self):
        key = jax.random.key_data(self.key)
        if self.actor_mesh is not None:  # a global array, so every process takes part in the Orbax save
            key = dist.replicate(np.asarray(key), self.actor_mesh)
        tree = {"actor": self.actor.state, "key": key}
        if self.extractor is not None:
            tree["extractor"] = self.extractor.state
        return tree

    def _experience_dir(self, step: int) -> str:
        return os.path.join(self.workdir, "experience", str(step))

    def save(self, force: bool = False) -> bool:
        """Experience store first (its own atomic directory per step), then the Orbax step that refers to it: a
        crash in between leaves no Orbax step, so resume falls back to a step whose store exists."""
        if not force and not self.save_due():
            return False
        self.join_extractor()
        if self.multi:
            dist.check_replicas(f"host state at step {self.step}", self.host_digest())
        if self.track is not None and self.leader:  # identical on every process: one writer
            self.track.save(self._experience_dir(self.step))
        dist.barrier(f"experience_{self.step}")
        host = {
            "step": self.step,
            "tasks": self.tasks.state_dict(),
            "config": json.loads(self.c.to_json_best_effort()),
        }
        saved = self.ckpt.save(self.step, self._train_tree(), {}, host, force=True)
        if self.leader:
            self._prune_experience()
        return saved

    def save_due(self) -> bool:
        return self.step % self.ckpt.save_every == 0

    def host_digest(self) -> str:
        """SHA-256 of the replicated host state (bank, buffer, counters, task sampler, step)."""
        return dist.host_digest(self.track, {"step": self.step, "tasks": self.tasks.state_dict()})

    def param_bytes(self) -> int:
        roles = [r for r in (self.actor, self.extractor) if r is not None]
        return sum(x.nbytes for r in roles for x in jax.tree.leaves(r.state.params))

    def digests(self) -> dict[str, Any]:
        """This process's replica digests (parameters and host state); identical on every process."""
        self.join_extractor()
        out = {"step": self.step, "process": jax.process_index(), "host": self.host_digest()}
        out["actor"] = dist.tree_digest(self.actor.state.params)
        if self.extractor is not None:
            out["extractor"] = dist.tree_digest(self.extractor.state.params)
        return out

    def _prune_experience(self) -> None:
        root = os.path.join(self.workdir, "experience")
        if not os.path.isdir(root):
            return
        keep = {str(s) for s in self.ckpt.all_steps()}
        for name in os.listdir(root):
            if name.isdigit() and name not in keep and int(name) < self.step:
                import shutil

                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def restore(self) -> bool:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self._train_tree()
        )
        got = self.ckpt.restore_latest(abstract)
        if got is None:
            return False
        step, train, arrays, host = got
        self.actor.state = train["actor"]
        self.actor.sampler.update_params(self.actor.state.params)
        if self.extractor is not None:
            self.extractor.state = train["extractor"]
            self.extractor.sampler.update_params(self.extractor.state.params)
        # Back to a process-local key (as in a fresh run): keys enter jitted calls as replicated inputs.
        self.key = jax.random.wrap_key_data(np.asarray(dist.local_replica(train["key"])))
        self.step = int(host["step"])
        self.tasks.load_state_dict(host["tasks"])
        if self.track is not None:
            self.track.load(self._experience_dir(self.step))
        log.info("resumed from step %d in %s", step, self.ckpt.directory)
        return True

    # -- one step ----------------------------------------------------------------------------------------
    def _specs(self, tasks, guided_ok: bool) -> list[EpisodeSpec]:
        K = self.c.rollout.group_size
        return [EpisodeSpec(t, k, guided_ok and k < K // 2) for t in tasks for k in range(K)]

    def rollout(self, tasks, *, guided_ok: bool, step: int, key) -> tuple[list, dict]:
        """All episodes of ``tasks``, ``rollout.rows_per_wave`` rows at a time (0 = all in one wave): a wave's
        KV cache is ``rows x max_context``, so waves bound rollout memory (launch/plan_memory.py --paper)."""
        specs = self._specs(tasks, guided_ok)
        w = self.c.rollout.rows_per_wave or len(specs)
        if len(specs) % w:
            raise ValueError(
                f"config key rollout.rows_per_wave={w} must divide the {len(specs)} episodes of a step "
                "(tasks x rollout.group_size)"
            )
        if w == len(specs):
            return self._rollout_wave(specs, guided_ok=guided_ok, step=step, key=key)
        trajs, timing = [], {}
        for i in range(0, len(specs), w):
            got, t = self._rollout_wave(
                specs[i : i + w], guided_ok=guided_ok, step=step, key=jax.random.fold_in(key, i // w)
            )
            trajs += got
            for k, v in t.items():
                timing[k] = timing.get(k, 0.0) + v
        return trajs, timing

    def _rollout_wave(self, specs, *, guided_ok: bool, step: int, key) -> tuple[list, dict]:
        t0 = time.perf_counter()
        w0 = time.time()
        gather = self._gather if self.multi else None
        resets = reset_all(self.pools, specs, gather)
        if guided_ok and self.track is not None:
            self.track.set_step(step)
            gi = [i for i, s in enumerate(specs) if s.guided]
            got = self.track.retrieve(
                [specs[i].task.env_id for i in gi], [resets[i][1].get("query", "") for i in gi]
            )
            for i, (block, uids) in zip(gi, got, strict=True):
                specs[i].experience, specs[i].entry_uids = block, uids
        r = self.c.retrieval
        ask = self.track.ask if (guided_ok and self.track is not None and r.search_and_ask) else None
        trajs, timing = run_episodes(
            self.pools,
            specs,
            resets,
            self.actor.sampler,
            self.actor.model.tokenizer,
            self.actor_sp,
            key,
            max_turns=self.c.env.max_turns,
            max_len=self.c.rollout.max_context,
            constraint_for=self._constraint if self.c.actor.constrained else None,
            ask=ask,
            ask_max=r.search_and_ask_max,
            gather=gather,
        )
        timing["rollout_s"] = time.perf_counter() - t0
        self._event("actor_rollout", step, w0, time.time())
        return trajs, timing

    def _gather(self, local: dict) -> dict:
        """Host exchange over the actor's devices (an extractor update in flight elsewhere is not waited for)."""
        devs = self.actor_mesh.devices.reshape(-1).tolist() if self.actor_mesh is not None else None
        return dist.allgather_objects(local, devs)

    def _event(self, name: str, step: int, start: float, end: float) -> None:
        """Wall-clock spans of the two tracks (``timeline.jsonl``): shows what overlapped what."""
        ev = {"event": name, "step": int(step), "start": start, "end": end}
        self.timeline.append(ev)
        if self.leader:
            with open(os.path.join(self.workdir, "timeline.jsonl"), "a") as f:
                f.write(json.dumps(ev) + "\n")

    def train_step(self) -> dict[str, float]:
        c, step = self.c, self.step
        self.key, k_roll = jax.random.split(self.key)
        tasks = self.tasks.next()
        # Offline Exp.: the first bank.offline_build_steps steps build the bank (actor frozen), then it is fixed.
        building = c.method == "offline" and step < c.bank.offline_build_steps
        if c.retrieval.search_and_ask:
            self.join_extractor()  # search & ask samples the extractor during the rollout
        trajs, timing = self.rollout(tasks, guided_ok=self.experience, step=step, key=k_roll)
        # The previous step's extractor update (disjoint placement) ran on its own devices during the rollout.
        self.join_extractor()
        rewards = np.array([outcome(t, t.spec.task.env_id) for t in trajs], np.float32)
        K = c.rollout.group_size
        sub = np.array([int(t.spec.guided) for t in trajs], np.int32)
        adv = np.asarray(
            subgroup_advantages(rewards.reshape(-1, K), sub.reshape(-1, K), c.actor.adv_norm, c.actor.adv_eps)
        ).reshape(-1)
        m: dict[str, float] = {}
        fut = None
        t_x = time.perf_counter()
        if self.track is not None:
            self.track.record_outcomes(trajs)
        t_up = time.perf_counter()
        am = None
        if self.train_actor and step >= c.actor.warmup_steps and not building:
            batch = batching.pack(
                [t.tokens for t in trajs],
                [_shift_free(t.loss_mask) for t in trajs],
                self.actor.model.tokenizer.pad_id,
            )
            batch.pop("row_valid")
            batch["advantages"] = adv
            batch["subgroup"] = sub
            am = _dispatch_update(self.actor, batch)  # async: returns before the device finishes
        if self.track is not None and (c.method != "offline" or building):
            # Distillation (extractor generation + ops) overlaps the actor update: a thread on one process, inline
            # after the actor's async dispatch on several (one thread issues all jitted calls, in order).
            fut = self.track.distill_async(trajs, step)
        if am is not None:
            m.update({f"actor/{k}": v for k, v in jax.device_get(am).items()})
        m["time/update_s"] = time.perf_counter() - t_up
        if fut is not None:
            fut.result()  # distillation of this step's trajectories (ran during the actor update)
            if c.bank.merge and (step + 1) % c.bank.merge_every == 0:
                self.track.merge(step)
            if self.train_extractor:
                xb = self.track.pop_batch(step)
                if xb is not None:
                    self._start_extractor_update(xb, step, m)
                    if not self.overlap_extractor:
                        self.join_extractor()
        if self.track is not None:
            m.update(self.track.stats())
        m["time/extraction_s"] = time.perf_counter() - t_x - m["time/update_s"]
        self.step += 1
        m.update(_rollout_metrics(trajs, rewards, c.env.tasks))
        m["time/rollout_s"] = timing["rollout_s"]
        m["time/gen_s"] = timing["gen_s"]
        m["time/env_s"] = timing["env_s"]
        gen = sum(sum(t.loss_mask) for t in trajs)
        m["tokens_s"] = gen / max(timing["gen_s"], 1e-9)
        return m

    def _start_extractor_update(self, xb, step: int, row: dict) -> None:
        """Dispatches the extractor's CISPO update (async); :meth:`join_extractor` adds its metrics to ``row``.

        With disjoint placement the join waits until after the next step's rollout, so the update runs on the
        extractor's devices while the actor's devices play episodes (SPEC §6); nothing reads the extractor in
        between (search & ask turns this off). The bank-side bookkeeping (``mark_trained``) needs only the batch
        and happens now, at its fixed point of the step.
        """
        tok = self.extractor.model.tokenizer
        seqs, masks = [], []
        for p, r in zip(xb.prompts, xb.responses, strict=True):
            ids, _ = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            resp = tok.encode(r)
            seqs.append(ids + resp)
            masks.append([0] * len(ids) + [1] * len(resp))
        batch = batching.pack(seqs, masks, tok.pad_id)
        batch.pop("row_valid")
        # Unweighted r - mean; the loss applies the Eq. 7 weights through sample_weight (once).
        batch["advantages"] = np.asarray(extractor_advantages(xb.rewards), np.float32)
        batch["sample_weight"] = np.asarray(xb.weights, np.float32)
        self.track.mark_trained(xb, step)
        t0 = time.time()
        dm = _dispatch_update(self.extractor, batch)
        done: dict[str, float] = {}
        # Records when the device work finished (a wait, not a dispatch: safe on any thread).
        watcher = threading.Thread(
            target=lambda: (jax.block_until_ready(dm), done.setdefault("end", time.time())),
            name="extractor-update-watch",
            daemon=True,
        )
        watcher.start()
        self._xpending = (row, dm, float(np.mean(xb.rewards)), step, t0, watcher, done)

    def join_extractor(self) -> None:
        """Waits for the extractor update in flight (if any) and puts its metrics in the row of its step."""
        if self._xpending is None:
            return
        row, dm, reward_mean, step, t0, watcher, done = self._xpending
        self._xpending = None
        out = jax.device_get(dm)
        watcher.join()
        out["reward_mean"] = reward_mean
        row.update({f"extractor/{k}": v for k, v in out.items()})
        self._event("extractor_update", step, t0, done.get("end", time.time()))

    @property
    def extractor_pending(self) -> bool:
        return self._xpending is not None

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, n_per_task: int, with_experience: bool) -> dict[str, float]:
        """Held-out tasks (disjoint seed range); greedy-free sampling as in training; per-env success."""
        self.join_extractor()
        tasks = self.tasks.eval_tasks(n_per_task)
        K = self.c.rollout.group_size
        slots = self.c.rollout.tasks_per_step * K
        scores: dict[str, list[float]] = {}
        key = jax.random.key(self.c.seed + 12345)
        per_call = max(slots // K, 1)
        for i in range(0, len(tasks), per_call):
            chunk = tasks[i : i + per_call]
            key, sub = jax.random.split(key)
            trajs, _ = self.rollout(
                chunk, guided_ok=with_experience and self.track is not None, step=self.step, key=sub
            )
            for t in trajs:
                if with_experience and self.track is not None and not t.spec.guided:
                    continue
                if not with_experience and t.spec.guided:
                    continue
                scores.setdefault(t.spec.task.env_id, []).append(outcome(t, t.spec.task.env_id))
        return {k: float(np.mean(v)) for k, v in scores.items()}

    def close(self) -> None:
        try:
            self.join_extractor()
        except Exception:  # noqa: BLE001 -- closing after a failure: release the pools regardless
            log.exception("extractor update in flight failed")
        self.pools.close()
        if self.track is not None:
            self.track.close()
        self.ckpt.close()


def _shift_free(mask: list[int]) -> list[int]:
    """Token 0 has no prediction: never in the loss."""
    return [0] + list(mask[1:]) if mask else mask


def _rollout_metrics(trajs, rewards, env_ids) -> dict[str, float]:
    m = {
        "success": float(np.mean([t.success for t in trajs])),
        "reward": float(np.mean(rewards)),
        "actions_per_episode": float(np.mean([t.turns for t in trajs])),
        "invalid_per_episode": float(np.mean([t.num_invalid for t in trajs])),
        "env_errors": float(sum(t.error is not None for t in trajs)),
    }
    for name, g in (("guided", True), ("free", False)):
        sel = [t.success for t in trajs if t.spec.guided == g]
        if sel:
            m[f"success/{name}"] = float(np.mean(sel))
    if len(env_ids) > 1:
        for e in env_ids:
            sel = [t.success for t in trajs if t.spec.task.env_id == e]
            if sel:
                m[f"success/{e.split('/')[-1]}"] = float(np.mean(sel))
    return m


def run(
    config,
    workdir: str,
    *,
    progress: bool = True,
    stop_after: int | None = None,
    row_extra: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Trains ``config`` in ``workdir`` (auto-resume), evaluates at the end, writes metrics, plot and eval.json.

    Args:
      stop_after: stop (with a checkpoint) after this many steps of *this* invocation (tests, preemption drills).
      row_extra: scalars merged into the first metrics row this invocation writes (e.g. ``config_changed``).
    Returns:
      ``{"step", "last_metrics", "eval"}``.
    """
    os.makedirs(workdir, exist_ok=True)
    if dist.is_leader():  # atomic: a crash never leaves a torn config.json
        tmp = os.path.join(workdir, "config.json.tmp")
        with open(tmp, "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        os.replace(tmp, os.path.join(workdir, "config.json"))
    tr = Trainer(config, workdir)
    try:
        resumed = tr.restore()
        writer = mlib.MetricsWriter(workdir, resume_step=tr.step if resumed else 0)
        mlib.start_memory_tracking()
        bar = None
        if progress and tr.leader:
            from tqdm import tqdm

            bar = tqdm(total=config.train.steps, initial=tr.step, desc=config.experiment, unit="step")
        last: dict[str, float] = {}
        done_here = 0
        rows: list[
            tuple[int, dict]
        ] = []  # written once complete (an extractor update may still be in flight)
        while tr.step < config.train.steps:
            t0 = time.perf_counter()
            m = tr.train_step()
            m["time/step_s"] = time.perf_counter() - t0
            mem = mlib.device_memory_mb()
            if mem is not None:
                m["device_mem_mb"] = mem
            rows.append((tr.step - 1, m))
            done_here += 1
            stopping = tr.step >= config.train.steps or (stop_after is not None and done_here >= stop_after)
            if stopping or tr.save_due():
                tr.join_extractor()
            for s, r in rows[: len(rows) - tr.extractor_pending]:
                if row_extra:
                    r, row_extra = {**r, **row_extra}, None
                last = writer.write(s, r)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(success=f"{r['success']:.2f}", bank=int(r.get("bank/size", 0)))
            rows = rows[len(rows) - tr.extractor_pending :]
            tr.save()
            if stopping:
                break
        tr.save(force=True)
        writer.flush()
        if not last and tr.leader and os.path.exists(writer.path):  # nothing ran here: the run's last row
            recorded = mlib.read_jsonl(writer.path)
            last = recorded[-1] if recorded else {}
        result: dict[str, Any] = {"step": tr.step, "last_metrics": last}
        eval_path = os.path.join(workdir, "eval.json")
        if tr.step >= config.train.steps and done_here == 0 and os.path.exists(eval_path):
            with open(eval_path) as f:  # a finished run: its evaluation is already on disk
                result["eval"] = json.load(f)
        elif tr.step >= config.train.steps:
            ev = {"without_exp": tr.evaluate(config.train.eval_tasks, with_experience=False)}
            if tr.track is not None:
                ev["with_exp"] = tr.evaluate(config.train.eval_tasks, with_experience=True)
            if tr.leader:
                with open(eval_path, "w") as f:
                    json.dump(ev, f, indent=2)
            result["eval"] = ev
            if tr.leader:
                mlib.plot_curves({config.method: writer.path}, os.path.join(workdir, "curves.png"))
        # Every process writes its replicas' digests: identical files = identical parameters, banks, buffers.
        # (Skipped past 1 GiB of parameters: a digest copies every replica to the host.)
        if tr.param_bytes() <= 2**30:
            result["digests"] = tr.digests()
            with open(os.path.join(workdir, f"digest_p{jax.process_index()}.json"), "w") as f:
                json.dump(result["digests"], f, indent=2)
        writer.close()
        if bar is not None:
            bar.close()
        return result
    finally:
        tr.close()
