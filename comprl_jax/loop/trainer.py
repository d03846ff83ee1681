"""The Complementary RL loop (SPEC §6) with every baseline of §8, exact resume, metrics and evaluation.

Step s (:meth:`Trainer.train_step` follows this order):
  1. tasks      draw tasks x K rollouts; K/2 guided (retrieved entry in the system prompt), K/2 free.
  2. rollout    play all episodes (env pools <-> actor sampler), token in / token out; guided episodes may use
                search & ask (the extractor answers as a tool turn).
  3. advantages subgroup-normalised (guided vs free) outcome advantages; infra failures masked out.
  4. extractor  record entry rewards into the buffer.
  5. actor      ``actor.updates_per_batch`` PPO-clip steps on the batch.
  6. bank       one extractor CISPO update per full buffer batch (dispatched); distil this step's trajectories;
                merge every ``bank.merge_every`` steps.
  7. metrics / checkpoint.
Distillation is producer-consumer with ``extractor.distill_overlap="rollout"`` (what ``auto`` picks on disjoint
placement): step s's generates in the background during step s+1's rollout, and its ops reach the bank right after
that rollout (or at a checkpoint, an evaluation or the end: :meth:`Trainer.join_distill`). With ``"update"`` (auto's
choice where the roles share devices) a step's distillation overlaps its actor update and is applied before its
extractor updates. The bank is changed only by the trainer's thread, at these
fixed points in a fixed order: the rollout reads a bank nothing writes, and the extractor trains on host batches
built before its updates (the release's freeze of the bank while the extractor trains holds by construction).
A resumed run is bit-identical.

Methods are flags (:data:`comprl_jax.config.METHOD_FLAGS`): ``actor.train``, ``extractor.train``,
``experience.enabled`` and ``bank.offline`` (the offline bank is built before step 0, outside ``train.steps``).

Devices (``mesh`` config, :mod:`comprl_jax.runtime.distributed`): one device -> no mesh; otherwise each role gets a
``(data, fsdp, tensor)`` mesh, shared (``colocated``) or on disjoint devices (``disjoint``: the extractor's updates
are dispatched at the end of step s and joined after step s+1's rollout, so the two run at the same time; their
metrics still land in row s). Several processes: replicated host state over SPMD device state (distributed.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from typing import Any

import jax
import numpy as np

from comprl_jax.config.run import RunConfig
from comprl_jax.envs import registry
from comprl_jax.experience.retrieval import blank_experience
from comprl_jax.loop import evaluation
from comprl_jax.loop.extractor_track import ExtractorTrack
from comprl_jax.loop.extractor_updates import ExtractorUpdates
from comprl_jax.loop.run_state import RunState
from comprl_jax.loop.vocab_corpus import action_words, tokenizer_corpus
from comprl_jax.models.zoo import TINY_SPECS, load_model, tiny_tokenizer
from comprl_jax.rl import self_distillation_select, subgroup_advantages
from comprl_jax.roles import actor_critic as critic_lib
from comprl_jax.roles import role as roles
from comprl_jax.roles.train_batches import actor_batch, strip_experience
from comprl_jax.rollout.engine import Rollout
from comprl_jax.rollout.engines import make_engine
from comprl_jax.rollout.episodes import EpisodeSpec, outcome
from comprl_jax.rollout.pools import Pools, reset_all
from comprl_jax.rollout.search_ask import (
    ASK_CLOSE,
    ASK_OPEN,
    ASK_QUERY_REGEX,
    NO_SEARCH_ASK,
    SearchAsk,
    search_ask_prompt,
)
from comprl_jax.rollout.tasks import TaskSampler
from comprl_jax.runtime import distributed as dist

log = logging.getLogger(__name__)

THINK_TEXT = (
    "[A-Za-z ,:.]"  # what a constrained think may hold (actor.think_chars): a lesson line, a sentence
)


class Trainer:
    def __init__(self, config, workdir: str, *, engine=None):
        """``config``: the run's ``ConfigDict`` (or its JSON tree): opened here, once, as a typed
        :class:`~comprl_jax.config.run.RunConfig`; the components below are built from its sections.
        ``engine``: a rollout engine in place of ``rollout.engine``'s (an :class:`~comprl_jax.rollout.engine.Engine`;
        a scripted actor of launch/bench/experience_matters.py, for experiments that script one side of the loop)."""
        self.engine_override = engine
        # the tree checkpoints record (what the run was started with)
        self.config_tree = json.loads(
            config.to_json_best_effort() if hasattr(config, "to_json_best_effort") else json.dumps(config)
        )
        self.config = cfg = RunConfig.of(config)
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.experience = bool(cfg.experience.enabled)
        self.train_actor = bool(cfg.actor.train)
        self.train_extractor = self.experience and bool(cfg.extractor.train)
        self.offline = self.experience and bool(cfg.bank.offline)
        self.tasks = TaskSampler(cfg.env.tasks, cfg.rollout.tasks_per_step, cfg.seed)
        slots = cfg.rollout.tasks_per_step * cfg.rollout.group_size
        # Each env plays at its own limits (SPEC §9) under the run's caps (env.max_turns,
        # actor.sampling.max_new_tokens, rollout.max_context): a mixture's ALFWorld keeps its 40 turns of 2,048 tokens.
        caps = (cfg.env.max_turns, cfg.actor.sampling.max_new_tokens, cfg.rollout.max_context)
        self.limits = {e: registry.capped(e, *caps) for e in cfg.env.tasks}
        turns = {e: lim.max_turns for e, lim in self.limits.items()}
        e = cfg.env
        self.pools = Pools(e.tasks, slots, e.workers, e.backend, turns, e.step_timeout_s, run_seed=cfg.seed)
        self._eval_pools: dict[str | None, Pools] = {}
        # Device meshes (None, None on one device). Multi-process: host state is replicated, see distributed.py.
        self.actor_mesh, self.extractor_mesh = dist.build_meshes(cfg.mesh)
        self.multi = dist.multi()
        self.leader = dist.is_leader()
        self.search_ask = self.experience and bool(cfg.retrieval.search_and_ask)
        # Disjoint placement: a step's extractor updates run on the extractor's devices during the next rollout,
        # joined after it. The extractor's sampler keeps the weights before them meanwhile (its refresh is deferred
        # to the join), so search & ask is answered during that rollout, on the ask thread of the continuous engine.
        self.overlap_extractor = self.actor_mesh is not None and cfg.mesh.placement == "disjoint"
        # Producer-consumer distillation (extractor.distill_overlap="rollout"; auto on disjoint placement): step s's
        # distillation generates during step s+1's rollout; its ops reach the bank at the next join (join_distill).
        overlap = cfg.extractor.distill_overlap
        self.distill_overlap = (
            ("rollout" if self.overlap_extractor else "update") if overlap == "auto" else overlap
        )
        self.timeline: list[dict] = []
        tok = self._tiny_tokenizer()
        self.actor_tiny = cfg.actor.model in TINY_SPECS  # its vocabulary spells each action as one token
        episodes = slots * len(cfg.env.tasks)
        self.sft_slots = episodes // 2 if (self.experience and cfg.actor.self_distill_coef > 0) else 0
        rows = episodes + self.sft_slots
        if rows % cfg.actor.updates_per_batch:
            raise ValueError(
                f"config key actor.updates_per_batch={cfg.actor.updates_per_batch} must divide the {rows} rows of "
                "the actor batch (tasks x group_size x envs, plus one self-distillation slot per guided episode)"
            )
        sft_coef = cfg.actor.self_distill_coef if self.sft_slots else 0.0
        actor_loss = dataclasses.replace(cfg.actor.loss, sft_coef=sft_coef)
        rows_per_update = rows // cfg.actor.updates_per_batch
        self.actor = self._role("actor", tok, cfg.seed, actor_loss, rows_per_update, self.actor_mesh)
        self.extractor = None
        self.track = None
        if self.experience:
            x = cfg.extractor
            self.extractor = self._role(
                "extractor", tok, cfg.seed + 1, x.loss, x.buffer.batch_size, self.extractor_mesh
            )
            from comprl_jax.models.embedders import embedder_from_config

            embedder = embedder_from_config(cfg.retrieval.embedder, mesh=self.extractor_mesh)
            self.track = ExtractorTrack(
                x, cfg.bank, cfg.retrieval, cfg.manager, embedder, self.extractor.sampler,
                self.extractor.model.tokenizer, cfg.seed, multi_process=self.multi,
            )  # fmt: skip
        # The extractor's updates and distillation in flight, and their joins (loop/extractor_updates.py).
        self.background = ExtractorUpdates(self.track, self.extractor, self._event)
        self.actor_sampling = cfg.actor.sampling
        self._constraints: dict[tuple[str, bool], Any] = {}
        # Every (env, may ask) constraint of the run: each play stacks them all, so the continuous engine compiles
        # one automaton shape per run, not one per evaluation play (Rollout.constraint_groups).
        flags = (False, True) if self.search_ask else (False,)
        self._constraint_groups = (
            tuple((env, f) for env in cfg.env.tasks for f in flags) if cfg.actor.constrained else ()
        )
        self.step = 0
        self.key = jax.random.key(cfg.seed)
        # Actor-critic: the actor's running success per env id ([successes, episodes]), shown to its judgement.
        self.task_stats: dict[str, list[int]] = {}
        self.offline_built = False
        # Orbax steps and experience stores on disk (loop/run_state.py)
        self.state_io = RunState(workdir, cfg.checkpoint, self.leader)

    # -- set-up helpers ------------------------------------------------------------------------------
    def _tiny_tokenizer(self):
        """The SentencePiece vocabulary of tiny random-init models, trained on the run's prompt strings (None when
        neither role is tiny). One process trains it; the others load it (the run directory is shared)."""
        models = (self.config.actor.model, self.config.extractor.model)
        if not any(str(m).startswith("tiny") for m in models):
            return None
        tok_dir = os.path.join(self.workdir, "tokenizer")
        tok = None
        if self.leader:
            corpus = tokenizer_corpus(self.pools, self.config.retrieval.search_and_ask_max)
            tok = tiny_tokenizer(corpus, tok_dir, words=action_words(self.pools))
        dist.barrier("tiny_tokenizer")
        return tok if self.leader else tiny_tokenizer([], tok_dir)

    def _role(self, name: str, tok, seed: int, loss, rows: int, mesh) -> roles.Role:
        """The ``actor`` / ``extractor`` role from its section: model, train state, update, sampler."""
        section = getattr(self.config, name)
        model = load_model(
            section.model, role=name, tokenizer=tok, seed=seed, mesh=mesh,
            param_dtype=section.param_dtype, dtype=section.dtype, attention=section.attention,
            moe_dispatch=section.moe_dispatch, moe_exchange_tokens=section.moe_exchange_tokens,
        )  # fmt: skip
        return roles.build_role(model, name, section, loss, rows, mesh)

    def _constraint(self, env_id: str, can_ask: bool = False):
        """The actor's decoding constraint (tiny / smollm): the env's action set, plus the search & ask tag."""
        if not self.config.actor.constrained:
            return None
        k = (env_id, can_ask)
        if k not in self._constraints:
            actions, regex = self.pools.action_spaces[env_id]
            ask = re.escape(ASK_OPEN) + ASK_QUERY_REGEX + re.escape(ASK_CLOSE)
            sampler = self.actor.sampler
            think = self.config.actor.think_chars
            if actions and think:  # a reply may first restate what applies (the warm actor copies its lesson)
                alternatives = "|".join(re.escape(a) for a in actions)
                answer = f"<think>{THINK_TEXT}{{0,{think}}}</think><answer>({alternatives})</answer>"
                c = sampler.regex_constraint(f"{answer}|{ask}" if can_ask else answer)
            elif actions and self.actor_tiny:
                # A random-init model has no spelling habits: one path per action (each action one token of its
                # vocabulary), so it starts uniform over the actions instead of skewed by the token paths.
                encode = self.actor.model.tokenizer.encode
                paths = tuple(tuple(encode(f"<answer>{a}</answer>")) for a in actions)
                c = sampler.sequences_constraint(paths, ask if can_ask else "")
            elif actions and not can_ask:  # a static action set (MiniHack, Sokoban)
                c = sampler.strings_constraint(tuple(f"<answer>{a}</answer>" for a in actions))
            elif actions:
                alternatives = "|".join(re.escape(a) for a in actions)
                c = sampler.regex_constraint(f"<answer>({alternatives})</answer>|{ask}")
            elif regex:  # else the action syntax (ALFWorld, WebShop)
                c = sampler.regex_constraint(f"({regex})|{ask}" if can_ask else regex)
            else:
                raise ValueError(
                    f"actor.constrained needs {env_id} to expose env.actions or env.action_regex"
                )
            self._constraints[k] = c
        return self._constraints[k]

    # -- state -----------------------------------------------------------------------------------------
    def _train_tree(self):
        key = jax.random.key_data(self.key)
        if self.actor_mesh is not None:  # a global array, so every process takes part in the Orbax save
            key = dist.replicate(np.asarray(key), self.actor_mesh)
        tree = {"actor": self.actor.state, "key": key}
        if self.extractor is not None:
            tree["extractor"] = self.extractor.state
        return tree

    def _host_state(self) -> dict:
        return {
            "step": self.step,
            "tasks": self.tasks.state_dict(),
            "task_stats": self.task_stats,
            "offline_built": self.offline_built,
        }

    def save(self, force: bool = False) -> bool:
        """A checkpoint of this step (when due, or ``force``): the experience store, then the Orbax step
        (:class:`~comprl_jax.loop.run_state.RunState`), after the extractor's updates in flight are joined."""
        if not force and not self.save_due():
            return False
        self.join_extractor()
        if self.multi:
            dist.check_replicas(f"host state at step {self.step}", self.host_digest())
        host = {**self._host_state(), "config": self.config_tree}
        return self.state_io.save(self.step, self._train_tree(), host, self.track)

    def save_due(self) -> bool:
        return self.state_io.due(self.step)

    def host_digest(self) -> str:
        """SHA-256 of the replicated host state (bank, buffer, counters, task sampler, step)."""
        return dist.host_digest(self.track, self._host_state())

    def param_bytes(self) -> int:
        roles_ = [r for r in (self.actor, self.extractor) if r is not None]
        return sum(x.nbytes for r in roles_ for x in jax.tree.leaves(r.state.params))

    def digests(self) -> dict[str, Any]:
        """This process's replica digests (parameters and host state); identical on every process."""
        self.join_extractor(refresh=False)  # reading the state changes nothing the run does next
        out = {"step": self.step, "process": jax.process_index(), "host": self.host_digest()}
        out["actor"] = dist.tree_digest(self.actor.state.params)
        if self.extractor is not None:
            out["extractor"] = dist.tree_digest(self.extractor.state.params)
        return out

    def restore(self) -> bool:
        """Resumes from the newest step whose checkpoint *and* experience store are both readable."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self._train_tree()
        )
        got = self.state_io.restore(
            abstract, self.track, lambda host: self.tasks.load_state_dict(host["tasks"])
        )
        if got is None:
            return False
        _, train, host = got
        self.actor.state = train["actor"]
        self.actor.sampler.update_params(self.actor.layout.refresh(self.actor.state.params))
        if self.extractor is not None:
            self.extractor.state = train["extractor"]
            self.extractor.sampler.update_params(self.extractor.layout.refresh(self.extractor.state.params))
        # Back to a process-local key (as in a fresh run): keys enter jitted calls as replicated inputs.
        self.key = jax.random.wrap_key_data(np.asarray(dist.local_replica(train["key"])))
        self.step = int(host["step"])
        self.task_stats = {k: list(v) for k, v in host.get("task_stats", {}).items()}
        self.offline_built = bool(host.get("offline_built", False))
        return True

    # -- one step ----------------------------------------------------------------------------------------
    def episode_specs(self, tasks, *, guided: bool, eval_mode: bool = False) -> list[EpisodeSpec]:
        """K episodes per task (training: K/2 guided + K/2 free when ``guided``); evaluation plays K/2 per task,
        all guided (with experience) or all free (without)."""
        K = self.config.rollout.group_size
        r = self.config.retrieval
        specs = []
        for t in tasks:
            for k in range(K // 2 if eval_mode else K):
                g = guided and (eval_mode or k < K // 2)
                ask = self.search_ask and (g or (not r.search_and_ask_guided_only and not eval_mode))
                lim = self.limits[t.env_id]
                specs.append(
                    EpisodeSpec(t, k, g, can_ask=ask, turn_tokens=lim.turn_tokens, context=lim.context)
                )
        return specs

    def rollout(self, tasks, *, guided_ok: bool, step: int, key) -> tuple[list, dict]:
        """All episodes of ``tasks`` (training), ``rollout.rows_per_wave`` rows at a time."""
        return self.play(self.episode_specs(tasks, guided=guided_ok), self.pools, step=step, key=key)

    def play(self, specs, pools: Pools, *, step: int, key, record: bool = True) -> tuple[list, dict]:
        """Plays ``specs`` in waves of ``rollout.rows_per_wave`` rows (0 = all at once): a wave's KV cache is
        ``rows x max_context``, so waves bound rollout memory (launch/plan_memory.py --paper).

        ``record=False`` (evaluation): read-only retrieval, search & ask without training samples, and nothing
        else that changes the run's state.
        """
        w = min(self.config.rollout.rows_per_wave or len(specs), len(specs))
        if record and len(specs) % w:  # (evaluation's last chunk may be short: its last wave is too)
            raise ValueError(
                f"config key rollout.rows_per_wave={w} must divide the {len(specs)} episodes of a step "
                "(tasks x rollout.group_size)"
            )
        trajs, timing = [], {}
        for i in range(0, len(specs), w):
            got, t = self._play_wave(
                specs[i : i + w], pools, step=step, key=jax.random.fold_in(key, i // w), record=record
            )
            trajs += got
            for k, v in t.items():
                timing[k] = timing.get(k, 0.0) + v
        return trajs, timing

    def _play_wave(self, specs, pools: Pools, *, step: int, key, record: bool) -> tuple[list, dict]:
        t0 = time.perf_counter()
        w0 = time.time()
        gather = self._gather if self.multi else None
        resets = reset_all(pools, specs, gather)
        gi = [i for i, s in enumerate(specs) if s.guided]
        if gi and self.track is not None:
            if record:
                self.track.set_step(step)
            got = self.track.retrieve(
                [specs[i].task.env_id for i in gi], [resets[i][1].get("query", "") for i in gi], record=record
            )
            for i, (block, uids) in zip(gi, got, strict=True):
                specs[i].experience, specs[i].entry_uids = block, uids
            if self.config.experience.blank:  # the control arm: same prompt length, no content
                count = lambda text: len(self.actor.model.tokenizer.encode(text))  # noqa: E731
                for i in gi:
                    specs[i].experience = blank_experience(specs[i].experience, count)
            if self.config.actor.actor_critic:
                self._judge([specs[i] for i in gi if specs[i].entry_uids], resets, specs, key)
        ask = None
        if self.search_ask and any(s.can_ask for s in specs):
            if record:
                ask = self.track.ask_many
            else:
                calls = iter(range(1 << 30))
                ask_key = jax.random.fold_in(key, 7)
                ask = lambda asks: self.track.ask_many(  # noqa: E731
                    asks, record=False, key=jax.random.fold_in(ask_key, next(calls))
                )
        rollout = Rollout(
            pools,
            self.actor.sampler,
            self.actor.model.tokenizer,
            self.actor_sampling,
            max_turns=self.config.env.max_turns,
            max_len=self.config.rollout.max_context,
            constraint_for=self._constraint if self.config.actor.constrained else None,
            search_ask=NO_SEARCH_ASK
            if ask is None
            else SearchAsk(ask, self.config.retrieval.search_and_ask_max),
            constraint_groups=self._constraint_groups,
        )
        engine = self.engine_override or make_engine(self.config.rollout, gather)
        trajs, timing = engine.play(rollout, specs, resets, key)
        timing["rollout_s"] = time.perf_counter() - t0
        if record:
            self._event("actor_rollout", step, w0, time.time())
        return trajs, timing

    def _judge(self, judged, resets, specs, key) -> None:
        """Actor-critic (SPEC §7): the actor accepts / refines / rejects each guided episode's entry."""
        if not judged:
            return
        index = {id(s): i for i, s in enumerate(specs)}
        items = []
        for s in judged:
            succ, n = self.task_stats.get(s.task.env_id, (0, 0))
            goal = resets[index[id(s)]][1].get("goal") or resets[index[id(s)]][1].get("query", "")
            items.append((str(goal), self.track.entry_text(s.entry_uids[0]), succ / n if n else None))
        constraint = (
            self.actor.sampler.regex_constraint(critic_lib.DECISION_REGEX)
            if self.config.actor.constrained
            else None
        )
        decisions = critic_lib.judge(
            self.actor.sampler,
            self.actor.model.tokenizer,
            self.actor_sampling,
            jax.random.fold_in(key, 1_000_003),
            items,
            constraint,
        )
        for s, d in zip(judged, decisions, strict=True):
            s.experience = d.experience(s.experience)
            s.critic_score = d.score

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

    def build_offline_bank(self) -> None:
        """Offline Exp. (SPEC §8): ``bank.offline_build_steps`` rounds of free rollouts by the frozen actor,
        every one distilled by the frozen extractor (``extractor.distill_from="guided"`` would keep none of these
        free episodes), then one merge and one deduplication pass (``bank.offline_dedup``); before step 0 and
        outside ``train.steps``. The bank is fixed afterwards. Saved as checkpoint step 0."""
        cfg = self.config
        build = TaskSampler(cfg.env.tasks, cfg.rollout.tasks_per_step, cfg.seed + 7_777)
        key = jax.random.key(cfg.seed + 7_777)
        for r in range(cfg.bank.offline_build_steps):
            trajs, _ = self.rollout(build.next(), guided_ok=False, step=-1, key=jax.random.fold_in(key, r))
            self.track.distill_async(trajs, -1, every=True).result()
        self.track.merge(-1)
        if cfg.bank.offline_dedup > 0:
            self.track.dedup(cfg.bank.offline_dedup)
        self.offline_built = True
        self.save(force=True)

    def train_step(self, fetch: bool = True) -> dict[str, Any]:
        """One step of SPEC §6, in its order. ``fetch=False``: the actor's device metrics are not read back
        (``train.log_every``)."""
        step = self.step
        self.key, k_roll = jax.random.split(self.key)
        tasks = self.tasks.next()
        # 1-2. rollout, with the weights the actor's sampler holds (refreshed after each of its updates)
        sampled_by = self.actor.version
        trajs, timing = self.rollout(tasks, guided_ok=self.experience, step=step, key=k_roll)
        # The previous step's extractor updates (disjoint placement) ran on their own devices during the rollout;
        # the extractor's sampler takes their weights now (it answered this rollout's search & ask with the older).
        self.join_extractor()
        # 3. advantages (infra failures are out of every statistic)
        rewards, valid, sub, adv = self._advantages(trajs)
        metrics: dict[str, Any] = {}
        t_x = time.perf_counter()
        # 4. extractor: entry rewards (distillation below; a frozen bank for Offline Exp.)
        distill = self.track is not None and not self.offline
        background = distill and self.distill_overlap == "rollout"
        metrics["time/distill_wait_s"] = self.background.take_distill_wait()
        if self.train_extractor:
            self.track.record_outcomes(trajs)
        # 5. actor update (async dispatch: returns before the device finishes)
        t_up = time.perf_counter()
        actor_metrics = self._dispatch_actor(trajs, adv, rewards, sub, valid, sampled_by, metrics)
        now = None
        if distill and not background:
            # Synchronous: overlaps the actor update (a thread on one process, inline after the actor's async
            # dispatch on several: one thread issues all jitted calls, in order); applied below, in this step.
            now = self.track.distill_launch(trajs, step)
        if actor_metrics is not None and fetch:
            metrics.update({f"actor/{k}": v for k, v in jax.device_get(actor_metrics).items()})
            # the sampler's weight copy (sampling.layout), refreshed after the update
            metrics["actor/rollout_refresh_s"] = self.actor.refresh_seconds()
        metrics["time/update_s"] = time.perf_counter() - t_up
        # 6. bank: ops applied, merge, extractor updates
        self._bank_and_extractor(trajs, step, now, distill, background, fetch, metrics)
        metrics["time/extraction_s"] = time.perf_counter() - t_x - metrics["time/update_s"]
        # 7. metrics
        self.step += 1
        metrics.update(_rollout_metrics(trajs, rewards, self.config.env.tasks))
        metrics.update(_timing_metrics(trajs, timing))
        return metrics

    def _advantages(self, trajs):
        """``(rewards, valid, subgroup, advantages)``, each ``[B]``: subgroup-normalised outcome advantages (guided
        vs free inside each group of K; infra failures masked out). Also counts the actor-critic's running
        success per env."""
        K, a = self.config.rollout.group_size, self.config.actor
        rewards = np.array([outcome(t) for t in trajs], np.float32)
        valid = np.array([not t.infra_failed for t in trajs], bool)
        sub = np.array([int(t.spec.guided) for t in trajs], np.int32)
        groups = (rewards.reshape(-1, K), sub.reshape(-1, K))
        adv = subgroup_advantages(*groups, a.adv_norm, a.adv_eps, valid=valid.reshape(-1, K))
        for t in trajs:
            if not t.infra_failed:
                s = self.task_stats.setdefault(t.spec.task.env_id, [0, 0])
                s[0] += int(t.success)
                s[1] += 1
        return rewards, valid, sub, np.asarray(adv).reshape(-1)

    def _dispatch_actor(self, trajs, adv, rewards, sub, valid, sampled_by, metrics):
        """The actor's PPO-clip steps on this batch (plus self-distillation rows), dispatched; None when the
        actor does not train this step (frozen, or ``actor.warmup_steps``)."""
        if not (self.train_actor and self.step >= self.config.actor.warmup_steps):
            return None
        sft = self._self_distillation_rows(trajs, rewards, sub, valid) if self.sft_slots else []
        pad = self.actor.model.tokenizer.pad_id
        batch = actor_batch(trajs, adv, sub, pad, sft=sft, sft_slots=self.sft_slots, sampled_by=sampled_by)
        if self.sft_slots:
            metrics["actor/sft_rows"] = float(len(sft))
        return roles.dispatch_update(self.actor, batch)

    def _bank_and_extractor(self, trajs, step, now, distill, background, fetch, metrics) -> None:
        """Step 6: the distillation's ops (``now``: generated during the actor update) reach the bank, the merge
        every ``bank.merge_every`` steps, the extractor's CISPO updates dispatched (joined here unless they overlap
        the next rollout), and the producer-consumer distillation launched (``background``)."""
        b = self.config.bank
        merge_now = distill and b.merge and (step + 1) % b.merge_every == 0
        if now is not None:
            metrics["time/distill_wait_s"] += self.track.distill_apply(now)
            if merge_now:
                self.track.merge(step)
        if fetch and self.background.refresh_unreported:  # the sampler copy's device time (sampling.layout)
            metrics["extractor/rollout_refresh_s"] = self.extractor.refresh_seconds()
            self.background.refresh_unreported = False
        if self.train_extractor:
            self.background.dispatch(step, metrics)
        if background:
            # Launched after the updates' dispatch: on a layout whose sampler reads the training state, the
            # sampler then holds its copy of the weights before them (roles.dispatch_update), which the
            # distillation samples while the updates run; the generation overlaps the next rollout.
            self.background.launch_distill(trajs, step)
            if merge_now:
                self.track.merge(step)
        if self.train_extractor and not self.overlap_extractor:
            self.join_extractor(
                refresh=False
            )  # the sampler's refresh stays at its fixed point (after the rollout)
        if self.track is not None:
            metrics.update(self.track.stats())

    def _self_distillation_rows(self, trajs, rewards, sub, valid) -> list[tuple[list[int], list[int]]]:
        """SPEC §7: guided trajectories that beat their group's free mean, experience stripped."""
        K = self.config.rollout.group_size
        chosen = np.asarray(
            self_distillation_select(rewards.reshape(-1, K), sub.reshape(-1, K), valid.reshape(-1, K))
        ).reshape(-1)
        tok = self.actor.model.tokenizer
        tool = search_ask_prompt(self.config.retrieval.search_and_ask_max)
        rows = []
        for t, pick in zip(trajs, chosen, strict=True):
            if pick:
                base = self.pools.system_prompts[t.spec.task.env_id]
                got = strip_experience(t, tok, base, tool if t.spec.can_ask else "")
                if got is not None:
                    rows.append(got)
        return rows[: self.sft_slots]

    def join_extractor(self, refresh: bool = True) -> bool:
        """Waits for the extractor updates in flight and puts their metrics in their rows; ``refresh``: joins the
        distillation, then the extractor's sampler takes the updated weights (returns whether it did).

        Where the refresh happens is fixed whatever the placement: after the next step's rollout (train_step), or
        at a checkpoint, an evaluation or the end. A co-located run joins its updates at the end of their own step
        with ``refresh=False``, so its search & ask during the next rollout samples the same weights as a disjoint
        run's, whose updates are still running then (tests/test_placement.py; loop/extractor_updates.py)."""
        return self.background.join(refresh)

    def join_distill(self) -> None:
        """Applies the background distillation's ops to the bank (waiting for it if needed)."""
        self.background.join_distill()

    @property
    def extractor_pending(self) -> bool:
        return self.background.in_flight

    # -- evaluation ----------------------------------------------------------------------------------
    def eval_pools(self, split: str | None) -> Pools:
        """Env pools on a held-out split (``None``: the training envs' own constructor, for seeded levels)."""
        if split not in self._eval_pools:
            cfg = self.config
            slots = cfg.rollout.tasks_per_step * cfg.rollout.group_size
            envs = [e for e in cfg.env.tasks if split in evaluation.splits_of(e, cfg.env.eval_split)]
            self._eval_pools[split] = Pools(
                envs,
                slots,
                cfg.env.workers,
                cfg.env.backend,
                {e: self.limits[e].max_turns for e in envs},
                cfg.env.step_timeout_s,
                env_kwargs=None if split is None else {"split": split},
                run_seed=cfg.seed,
            )
        return self._eval_pools[split]

    def evaluate(self, n_per_task: int, with_experience: bool) -> dict[str, dict]:
        """Held-out success per env (and split): see :mod:`comprl_jax.loop.evaluation`."""
        self.join_extractor()
        player = evaluation.Player(
            specs=lambda tasks, guided: self.episode_specs(tasks, guided=guided, eval_mode=True),
            play=lambda specs, pools, key: self.play(specs, pools, step=self.step, key=key, record=False)[0],
            pools=self.eval_pools,
        )
        c = self.config
        return evaluation.evaluate(
            c.env,
            player,
            n_per_task,
            with_experience and self.track is not None,
            seed=c.seed,
            per_call=c.rollout.tasks_per_step * 2,  # tasks x K/2 episodes = the training pools' slots
            full_splits=c.train.eval_full_splits,
        )

    def evaluate_modes(self, n_per_task: int) -> dict[str, dict]:
        """``{"without_exp": ..., "with_exp": ...}`` (the latter only when the run uses experience)."""
        ev = {"without_exp": self.evaluate(n_per_task, with_experience=False)}
        if self.track is not None:
            ev["with_exp"] = self.evaluate(n_per_task, with_experience=True)
        return ev

    def close(self) -> None:
        try:
            self.join_extractor()
        except Exception:  # noqa: BLE001 -- closing after a failure: release the pools regardless
            log.exception("extractor update in flight failed")
        self.pools.close()
        for p in self._eval_pools.values():
            p.close()
        if self.track is not None:
            self.track.close()
        self.state_io.ckpt.close()


def _timing_metrics(trajs, timing: dict) -> dict[str, float]:
    """The rollout's wall times, sampled tokens per second, and the continuous engine's slot utilisation."""
    out = {f"time/{k}": timing[k] for k in ("rollout_s", "gen_s", "env_s")}
    gen = sum(sum(t.loss_mask) for t in trajs)
    out["tokens_s"] = gen / max(timing["gen_s"], 1e-9)
    if timing.get("slot_steps"):  # continuous engine: sampled tokens / (decode steps x slots)
        out["rollout/slot_utilisation"] = timing["generated"] / timing["slot_steps"]
    return out


def _rollout_metrics(trajs, rewards, env_ids) -> dict[str, float]:
    """Per-step episode metrics; success rates are over episodes that did not fail for infra reasons."""
    ok = [t for t in trajs if not t.infra_failed]

    def rate(sel):
        return float(np.mean([t.success for t in sel])) if sel else float("nan")

    m = {
        "success": rate(ok),
        "reward": float(np.mean([r for t, r in zip(trajs, rewards, strict=True) if not t.infra_failed]))
        if ok
        else float("nan"),
        "actions_per_episode": float(np.mean([t.turns for t in ok])) if ok else float("nan"),
        "invalid_per_episode": float(np.mean([t.num_invalid for t in ok])) if ok else float("nan"),
        "episodes_failed_infra": float(len(trajs) - len(ok)),
    }
    for name, g in (("guided", True), ("free", False)):
        sel = [t for t in ok if t.spec.guided == g]
        if sel:
            m[f"success/{name}"] = rate(sel)
    askers = [t for t in trajs if t.spec.can_ask]
    if askers:
        m["search_ask/calls_per_episode"] = float(np.mean([t.asks for t in askers]))
    judged = [t.spec.critic_score for t in trajs if t.spec.critic_score is not None]
    if judged:
        for verdict, s in (("accept", 1.0), ("refine", 0.5), ("reject", 0.0)):
            m[f"critic/{verdict}"] = float(np.mean([x == s for x in judged]))
    if len(env_ids) > 1:
        for e in env_ids:
            sel = [t for t in ok if t.spec.task.env_id == e]
            if sel:
                m[f"success/{e.split('/')[-1]}"] = rate(sel)
    return m
