"""The slot engine (sampling/slots.py) on a paged KV cache: a scripted run of enters, decode chunks, parking,
continuing from a park row, releases, new occupants and a compaction gives the same tokens and log-probabilities
as on the dense cache, while the rows move by their page lists on the host (no device copy) and the pool's used
pages are exactly the pages the live rows hold."""

import jax
import numpy as np
import pytest

from comprl_jax.sampling import SamplerService, SamplingParams
from comprl_jax.sampling import slots as slots_mod
from comprl_jax.sampling.pages import PageTable
from comprl_jax.sampling.slots import Entry, SlotBatch

V = 300
PAGE = 16


def _cfg():
    from comprl_jax.models import ModelConfig

    return ModelConfig.tiny(
        "qwen3",
        vocab_size=V,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )


@pytest.fixture(scope="module")
def services():
    from comprl_jax.models import init_decoder

    cfg = _cfg()
    graphdef, params = init_decoder(cfg, seed=0)
    kw = dict(stop_token_ids=(3,), pad_id=0)
    return (
        SamplerService(graphdef, params, cfg, **kw),
        SamplerService(graphdef, params, cfg, kv_cache="paged", page_size=PAGE, **kw),
    )


def _check_pages(sb: SlotBatch, live: dict[int, int], parked: dict[int, int]) -> None:
    """The pool's used pages are exactly those of the live slots (``live``: slot -> positions reserved) and the
    parked rows (``parked``: park row -> positions), each row holding ``ceil(positions / page)`` distinct pages;
    the device's pool and page table agree with the host's (once sent)."""
    pt = sb.pages
    held = [p for o in pt.owned for p in o] + [p for o in sb.park_pages for p in o]
    assert len(held) == len(set(held)) == pt.used  # no page owned twice, none leaked
    assert sorted(set(range(pt.num_pages)) - set(held)) == pt.free
    for b, o in enumerate(pt.owned):
        assert len(o) == -(-live.get(b, 0) // PAGE), (b, o, live)
    for r, o in enumerate(sb.park_pages):
        assert len(o) == -(-parked.get(r, 0) // PAGE), (r, o, parked)
    assert sb.cache.k.size == pt.num_pages * PAGE * 2 * 2 * 16  # the pool: L x Hkv x pages x page x Dh
    if not sb._table_stale:  # (a park or vacate changes the host's table; the next call sends it)
        np.testing.assert_array_equal(np.asarray(sb.cache.pages), pt.table())


def _script(service, sp, prompts, check=None):
    """The scripted run on 4 slots; {(episode, turn): Finished}. ``check(sb, step)`` is called between steps
    (paged: the page accounting)."""
    key = jax.random.key(11)
    sb = SlotBatch(service, 4, 512, sp, chunk_steps=5)
    got, occ = {}, {}  # (episode, turn) -> Finished; slot -> (episode, turn)
    turn = {}

    def enter(items):
        es = []
        for slot, ep, reset, park_row, mx in items:
            t = turn.get(ep, 0)
            if t == 0:
                toks = prompts[ep]
            else:  # the last reply's last token (never fed) first, then an observation
                toks = [int(got[ep, t - 1].tokens[-1])] + [40 + ep, 41 + t, 42]
            es.append(Entry(slot, toks, reset, mx, (ep, t), park_row=park_row))
            occ[slot] = (ep, t)
            turn[ep] = t + 1
        sb.enter(es, key)

    def chunk(exit_done=1):
        for f in sb.collect(sb.advance(exit_done)):
            got[occ.pop(f.slot)] = f

    def drain():
        while sb.replying:
            chunk()

    # 1. Two new occupants; one chunk; two more enter while the first two reply (the enter's decode step).
    enter([(0, 0, True, -1, 12), (1, 1, True, -1, 16)])
    chunk()
    enter([(2, 2, True, -1, 9), (3, 3, True, -1, 14)])
    drain()
    if check:
        check(sb, 1)
    # 2. Park slots 0 and 1 (episodes 0, 1); a new episode takes slot 0, episode 0 continues from its park row in
    # slot 1, episode 2 continues in its own slot.
    rows = sb.park([0, 1])
    if check:
        check(sb, 2)
    enter([(0, 4, True, -1, 16), (1, 0, False, rows[0], 10), (2, 2, False, -1, 16)])
    chunk()
    if check:
        check(sb, 3)
    drain()
    # 3. Episode 1 ended while parked (release); episode 3 continues; a new occupant (episode 5) replaces episode 4.
    sb.release([rows[1]])
    enter([(3, 3, False, -1, 8), (0, 5, True, -1, 16)])
    drain()
    if check:
        check(sb, 4)
    # 4. The tail: episodes 0 (slot 1) and 3 (slot 3) live on; compact to 2 rows, then a last turn each.
    before = sb.B
    moved = sb.compact([1, 3])
    if service.batch_bucket(2) < before:
        assert moved == {1: 0, 3: 1} and sb.B == 2
    else:  # on a mesh whose data axis is wider than 2 rows nothing shrinks
        assert moved == {1: 1, 3: 3} and sb.B == before
    if check:
        check(sb, 5)
    enter([(moved[1], 0, False, -1, 16), (moved[3], 3, False, -1, 12)])
    drain()
    if check:
        check(sb, 6)
    return got, sb


def test_paged_slots_equal_dense(services, monkeypatch):
    dense, paged = services
    rng = np.random.default_rng(4)
    # Long prompts (up to 15 pages) so that a parked row and the slots' rows outgrow the first pool (256 positions
    # per slot), and episode 3's last turn passes 256 positions (the dense cache grows, the paged window widens).
    prompts = [rng.integers(40, V, int(n)).tolist() for n in (150, 190, 200, 230, 230, 60)]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0)

    ref, dsb = _script(dense, sp, prompts)
    assert dsb.cache_len == 512  # episode 3's last turn grew the dense cache (and widened the paged window)

    def no_copy(*a, **k):
        raise AssertionError("a paged slot engine copied rows on device")

    monkeypatch.setattr(slots_mod, "_park", no_copy)
    monkeypatch.setattr(slots_mod, "_grow_rows", no_copy)
    seen = {}

    def check(sb, step):
        pt, r = sb.pages, sb.reserved
        if step == 1:  # every slot holds its first turn
            _check_pages(sb, {b: r[b] for b in range(4)}, {})
            seen["first_turn"] = {b: list(pt.owned[b]) for b in range(4)}
            seen["k"] = sb.cache.k
        elif step == 2:  # slots 0, 1 parked: their page lists moved, the pool untouched
            assert sb.park_store is None and sb.cache.k is seen["k"]
            assert [list(p) for p in sb.park_pages[:2]] == [seen["first_turn"][0], seen["first_turn"][1]]
            _check_pages(sb, {2: r[2], 3: r[3]}, {0: len(prompts[0]) + 12, 1: len(prompts[1]) + 16})
        elif step == 3:  # episode 0 continues in slot 1 on its own pages (then more); slot 0 has new ones
            assert pt.owned[1][: len(seen["first_turn"][0])] == seen["first_turn"][0]
            _check_pages(sb, {b: r[b] for b in range(4)}, {1: len(prompts[1]) + 16})
            assert pt.num_pages > 4 * 256 // PAGE  # the pool grew (doubled) for the parked rows
        elif step == 4:  # episode 1's parked pages were freed, and episode 4's (slot 0) for its new occupant
            _check_pages(sb, {b: r[b] for b in range(4)}, {})
        elif step == 5:  # compaction: rows 1, 3 -> 0, 1; rows 0, 2 freed; the pool stays
            _check_pages(sb, {0: r[0], 1: r[1]}, {})
            assert np.asarray(sb.cache.lengths).tolist() == sb.lengths.tolist()
        else:
            _check_pages(sb, {0: r[0], 1: r[1]}, {})
            used, held = pt.used, len(pt.owned[0])
            sb.vacate([0])  # an ended occupant's pages go back at once
            assert held and pt.used == used - held and pt.owned[0] == [] and sb.lengths[0] == 0

    got, sb = _script(paged, sp, prompts, check)
    assert set(seen) == {"first_turn", "k"}
    assert sorted(got) == sorted(ref) and len(got) == 11
    for k, f in ref.items():
        assert got[k].tokens.tolist() == f.tokens.tolist(), k
        np.testing.assert_array_equal(got[k].logprobs, f.logprobs, err_msg=str(k))
        assert got[k].finish == f.finish, k
    assert len({tuple(f.tokens.tolist()) for f in got.values()}) > 6  # sampled: the replies differ


def test_page_table_moves():
    pt = PageTable(3, 64, 16, 6)
    pt.reserve({0: 20, 1: 40})  # 2 + 3 pages
    assert pt.owned == [[0, 1], [2, 3, 4], []] and pt.used == 5
    held = pt.take(1)
    assert held == [2, 3, 4] and pt.owned[1] == [] and pt.used == 5  # held outside the table, not freed
    pt.give(2, held)
    assert pt.table()[2].tolist() == [2, 3, 4, 6]
    with pytest.raises(ValueError, match="row 2 owns 3 pages"):
        pt.give(2, [5])
    pt.keep_rows([2], 2)  # row 0's pages freed, row 2 -> row 0
    assert pt.owned == [[2, 3, 4], []] and pt.free == [0, 1, 5] and pt.rows == 2
    pt.free_pages(pt.take(0))
    assert pt.used == 0 and pt.table().shape == (2, 4)


@pytest.mark.parametrize("tensor", [1, 2])
def test_paged_slots_on_a_decode_mesh_equal_one_device_dense(tensor):
    """The paged slot engine with the sampler's weights on its decode mesh of 8 fake devices (data 8, or data 4 x
    tensor 2; sampling/layout.py) samples the scripted run's tokens of the dense engine on one device."""
    from comprl_jax.models import decoder
    from comprl_jax.runtime import sharding as shd
    from comprl_jax.sampling.layout import rollout_layout

    cfg = _cfg()
    mesh = shd.make_mesh({"fsdp": 8})
    graphdef, params = decoder.init_decoder(cfg, seed=0, mesh=mesh)
    kw = dict(stop_token_ids=(3,), pad_id=0)
    dense = SamplerService(graphdef, jax.device_put(params, jax.devices()[0]), cfg, **kw)
    layout = rollout_layout(params, cfg, mesh, tensor)
    paged = SamplerService(
        graphdef, layout.refresh(params), cfg, mesh=layout.mesh, kv_cache="paged", page_size=PAGE, **kw
    )
    rng = np.random.default_rng(4)
    prompts = [rng.integers(40, V, int(n)).tolist() for n in (150, 190, 200, 230, 230, 60)]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0)
    ref, _ = _script(dense, sp, prompts)
    got, sb = _script(paged, sp, prompts)
    assert dict(sb.cache.k.sharding.mesh.shape) == {"data": 8 // tensor, "fsdp": 1, "tensor": tensor}
    assert sorted(got) == sorted(ref)
    for k, f in ref.items():
        assert got[k].tokens.tolist() == f.tokens.tolist(), k
        np.testing.assert_allclose(got[k].logprobs, f.logprobs, atol=1e-5, err_msg=str(k))
