"""Unit behaviour of the processing pipeline, the acceptance rules and the decoding loops."""
import math

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.shared.protocol import ModelOutput
from fastar.samplers.token_loops.acceptance import EntropyRule, ExactRule, GroupedRule, positive_residual
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings, probabilities
from tiny_llamagen import tiny_conditioning, tiny_model


def test_sampling_draws_each_code_with_its_mass_and_never_a_code_without():
    from fastar.samplers import processing

    dist = torch.tensor([[0.0, 0.2, 0.0, 0.0, 0.5, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    rows = 40000
    draws = processing.sample(dist.repeat(rows, 1).view(rows, 2, 7), torch.Generator().manual_seed(0))
    freq = torch.stack([torch.bincount(draws[:, r], minlength=7) / rows for r in range(2)])
    assert (freq[dist == 0] == 0).all() and (freq - dist).abs().max() < 0.01  # 4 standard errors at 0.5
    for edge in (0.0, 1.0 - 2 ** -24):  # the ends of torch.rand's range
        original = processing.uniform
        processing.uniform = lambda shape, generator: torch.full(shape, edge)
        try:
            picked = processing.sample(dist, torch.Generator())
        finally:
            processing.uniform = original
        assert dist[torch.arange(2), picked].gt(0).all(), (edge, picked)


def test_cfg_temperature_topk_topp_follow_the_official_order():
    cond = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    uncond = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    s = SamplingSettings(cfg_scale=2.0, temperature=0.5, top_k=4, top_p=0.99)
    got = probabilities(ModelOutput(cond, uncond), s)
    mixed = uncond + (cond - uncond) * 2.0  # [3, 1, 0, -1, -3]
    logits = mixed / 0.5  # [6, 2, 0, -2, -6]
    logits[0, 4] = float("-inf")  # top-k 4
    probs = logits.softmax(-1)  # [0.9817, 0.0180, 0.0024, ...]: the 2nd token crosses 0.99, the 3rd is dropped
    logits[0, 2:] = float("-inf")
    assert torch.allclose(got, logits.softmax(-1), atol=1e-6)
    assert probs[0, 0] < 0.99 < probs[0, :2].sum()


def test_topk_and_topp_keep_ties_and_greedy_is_one_hot():
    out = ModelOutput(torch.tensor([[1.0, 3.0, 3.0, 0.0]]))
    assert (probabilities(out, SamplingSettings(cfg_scale=1.0, top_k=1)) > 0).sum() == 2
    # the first 3.0 alone holds 0.45 of the mass, crossing 0.3: its tie stays too, whichever the sort put first
    assert (probabilities(out, SamplingSettings(cfg_scale=1.0, top_p=0.3)) > 0).tolist() == [[False, True, True, False]]
    greedy = probabilities(out, SamplingSettings(cfg_scale=1.0, temperature=0.0))
    assert greedy.sum() == 1 and greedy.max() == 1


@pytest.mark.parametrize("bad", [dict(cfg_scale=-1), dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0),
                                 dict(top_p=1.5)])
def test_out_of_range_sampling_settings_are_refused(bad):
    with pytest.raises(FastARError):
        SamplingSettings(**bad).validate()


def test_residual_removes_the_draft_mass_and_falls_back_when_equal():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(positive_residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(positive_residual(p, p), p)


# codes on a line: code i sits at position i, so code 3's neighbours by distance are 2 and 4, then 1 and 5
LINE = torch.arange(6.0).unsqueeze(1)


def grouped(group, **kw):
    return GroupedRule(group, LINE, **kw)


def test_group_one_is_the_exact_rule():
    p = torch.tensor([[[0.4, 0.3, 0.1, 0.1, 0.05, 0.05]]])
    q = torch.full((1, 1, 6), 1 / 6)
    x = torch.tensor([[1]])
    assert torch.allclose(grouped(1).accept_probability(p, q, x), ExactRule().accept_probability(p, q, x))


def test_group_sums_the_neighbours_by_target_rank():
    p = torch.tensor([[[0.05, 0.4, 0.1, 0.3, 0.1, 0.05]]])  # ranks: 1 > 3 > {2, 4} > {0, 5}
    q = torch.tensor([[[0.0, 0.1, 0.0, 0.9, 0.0, 0.0]]])
    x = torch.tensor([[3]])  # rank 1: the group of size 3 is ranks 0..2 = codes 1, 3 and one 0.1 code
    rule = grouped(3, prob_threshold=1.0, distance_threshold=1.0)
    assert torch.allclose(rule.accept_probability(p, q, x), torch.tensor([[0.8 / 1.0]]))
    assert ExactRule().accept_probability(p, q, x) < rule.accept_probability(p, q, x)


def test_group_filters_by_probability_gap_distance_and_support():
    p = torch.tensor([[[0.05, 0.4, 0.1, 0.3, 0.1, 0.05]]])
    q = torch.tensor([[[0.0, 0.1, 0.0, 0.9, 0.0, 0.0]]])
    x = torch.tensor([[3]])
    # code 1 differs from p(x) by 0.1 > 0.05: dropped, like the 0.1 code (gap 0.2)
    assert torch.allclose(grouped(3, prob_threshold=0.05, distance_threshold=1.0).accept_probability(p, q, x),
                          torch.tensor([[0.3 / 0.9]]))
    # the group of 3 is codes {1, 3, 2 or 4}; code 1 is two steps from code 3, farther than the nearest
    # half of the codes (3 itself and 2, 4), so it is dropped; the 0.1 code (2 or 4) stays
    half = grouped(3, prob_threshold=1.0, distance_threshold=0.5).accept_probability(p, q, x)
    assert torch.allclose(half, torch.tensor([[0.4 / 0.9]]))
    # distance 0: only x itself (and exact duplicates) is left
    assert torch.allclose(grouped(3, prob_threshold=1.0, distance_threshold=0.0).accept_probability(p, q, x),
                          torch.tensor([[0.3 / 0.9]]))
    # a code outside the target's support is never accepted
    p_cut = torch.tensor([[[0.0, 0.5, 0.1, 0.3, 0.1, 0.0]]])
    q_cut = torch.tensor([[[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]]])
    assert grouped(50, prob_threshold=1.0, distance_threshold=1.0).accept_probability(p_cut, q_cut, torch.tensor([[0]])) == 0


def test_entropy_rule_shrinks_the_draw_by_the_targets_normalised_entropy():
    p = torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.1, 0.9, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.0, 1.0, 0.0, 0.0]]])
    x = torch.tensor([[1, 2, 1]])
    entropy = -(p[0, 0] * p[0, 0].log()).sum()
    scale = entropy / math.log(4) + 0.05  # 0.73: the first slot's draft is accepted with 0.1 / (0.9 * 0.73)
    rule = EntropyRule(1.0).accept_probability(p, q, x)
    assert torch.allclose(rule, torch.tensor([[0.1 / (0.9 * scale), 0.25 / 0.5, 0.0]]))  # uniform: s = 1; p(x) = 0: 0
    half = EntropyRule(0.5).accept_probability(p, q, x)
    assert torch.allclose(half[0, 0], torch.tensor(0.1 / (0.9 * (1 - 0.5 * (1 - scale)))))
    assert torch.equal(EntropyRule(0.0).accept_probability(p, q, x), ExactRule().accept_probability(p, q, x))
    assert torch.equal(EntropyRule(1.0).residual(p, q, x), positive_residual(p, q))  # the reference's residual


@pytest.mark.parametrize("changes, message", [
    (dict(distance_threshold=1.5), "GSD thresholds"), (dict(prob_threshold=-0.1), "GSD thresholds"),
    (dict(group=0), "GSD group size 0"),
    (dict(window=1), "Jacobi window 1"), (dict(gamma=0), "gamma 0"), (dict(lantern_k=0), "LANTERN k 0"),
    (dict(lantern_delta=-0.5), "LANTERN delta"), (dict(flow_steps=1), "flow-map steps 1"),
    (dict(entropy_strength=1.5), "entropy strength 1.5")])
def test_settings_out_of_range_are_refused_by_the_spec_and_by_decode(changes, message):
    spec = DecoderSpec("gsd", **changes)
    with pytest.raises(FastARError, match=message):
        spec.validate()
    model = tiny_model()
    with pytest.raises(FastARError, match=message):  # the decoders' entrance checks it too (the nodes' path)
        decode(model, tiny_conditioning(model), SamplingSettings(), spec, seed=0)


def test_group_distance_is_scale_free():
    e = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    p = torch.tensor([[[0.05, 0.4, 0.1, 0.3, 0.1, 0.05]]])
    q = torch.tensor([[[0.1, 0.1, 0.1, 0.5, 0.1, 0.1]]])
    x = torch.tensor([[3]])
    small = GroupedRule(5, e, prob_threshold=1.0, distance_threshold=0.5).accept_probability(p, q, x)
    large = GroupedRule(5, e * 1000.0, prob_threshold=1.0, distance_threshold=0.5).accept_probability(p, q, x)
    everything = GroupedRule(5, e, prob_threshold=1.0, distance_threshold=1.0).accept_probability(p, q, x)
    assert torch.allclose(small, large)
    assert small < everything  # the filter did drop someone


def test_relative_probability_filter_means_the_same_at_every_scale():
    """The paper's absolute gap drops every member next to a confident draft; the relative one keeps the
    members within the same ratio whether the draft holds 0.6 or 0.006 of the mass."""
    q = torch.tensor([[[0.05, 0.0, 0.05, 0.9, 0.0, 0.0]]])
    x = torch.tensor([[3]])
    confident = torch.tensor([[[0.1, 0.3, 0.05, 0.5, 0.05, 0.0]]])  # code 1: gap 0.2 = 0.4 of max(p)
    flat = confident * 0.01
    flat[..., 0] = 1 - flat[..., 1:].sum()  # the rest of the mass on code 0, now ranked first: far off
    by_hand = (0.5 + 0.3) / 0.9  # x and code 1 kept: p and q scale alike, the ratio does not move
    for p in (confident, flat):
        relative = grouped(3, prob_filter="relative", prob_threshold=0.5, distance_threshold=1.0)
        accepted = relative.accept_probability(p, q, x)
        assert torch.allclose(accepted, torch.tensor([[by_hand]]) * p[0, 0, 3] / 0.5)
        assert torch.allclose(accepted / ExactRule().accept_probability(p, q, x), torch.tensor([[1.6]]))
    # a tighter ratio drops code 1 at both scales; the absolute 0.15 drops it only next to the confident draft
    tight = grouped(3, prob_filter="relative", prob_threshold=0.3, distance_threshold=1.0)
    absolute = grouped(3, prob_threshold=0.15, distance_threshold=1.0)
    for p in (confident, flat):
        assert torch.allclose(tight.accept_probability(p, q, x), ExactRule().accept_probability(p, q, x))
    assert torch.allclose(absolute.accept_probability(confident, q, x), ExactRule().accept_probability(confident, q, x))
    assert absolute.accept_probability(flat, q, x) > ExactRule().accept_probability(flat, q, x)
    with pytest.raises(FastARError, match="GSD probability filter"):
        grouped(3, prob_filter="ratio")


def test_gsd_radius_is_computed_once_per_table_and_stays_on_its_device(monkeypatch):
    from fastar.samplers.token_loops import acceptance

    calls = []
    real = acceptance._radius
    monkeypatch.setattr(acceptance, "_radius", lambda e, f: calls.append(f) or real(e, f))
    table = torch.randn(40, 4, generator=torch.Generator().manual_seed(11))
    first = GroupedRule(5, table, distance_threshold=0.3)
    again = GroupedRule(5, table.clone(), distance_threshold=0.3)  # same content, a fresh tensor
    GroupedRule(5, table, distance_threshold=0.6)
    assert calls == [0.3, 0.6]
    assert again.radius is first.radius and first.radius.device == table.device


def test_table_fingerprints_read_a_large_table_in_chunks(monkeypatch):
    """In chunks (a 7B table in float64 at once is a gigabyte): the same content gives the same key, a changed
    value or a moved value another."""
    from fastar.samplers.token_loops import table_cache

    monkeypatch.setattr(table_cache, "FINGERPRINT_CHUNK", 7)
    table = torch.randn(40, 4, generator=torch.Generator().manual_seed(11))
    swapped, changed = table.clone(), table.clone()
    swapped[[3, 30]] = table[[30, 3]]
    changed[39, 3] += 1e-3
    key = table_cache.fingerprint(table)
    assert table_cache.fingerprint(table.clone()) == key
    assert table_cache.fingerprint(swapped) != key and table_cache.fingerprint(changed) != key


def test_gsd_cluster_distances_in_chunks_change_nothing(monkeypatch):
    """GSD's code distances are computed a few drafts at a time (a 1000-code group at 7B width would gather
    gigabytes at once): the same tokens as all at once."""
    from fastar.samplers.token_loops import acceptance

    model, spec, sampling = tiny_model(seed=3), DecoderSpec("gsd", window=6, group=9), SamplingSettings(top_k=30)
    want, _ = decode(model, tiny_conditioning(model), sampling, spec, seed=4)
    monkeypatch.setattr(acceptance, "DISTANCE_CHUNK", 1)  # one draft at a time
    got, _ = decode(model, tiny_conditioning(model), sampling, spec, seed=4)
    assert torch.equal(got, want)


def test_setup_counts_in_the_wall_time(monkeypatch):
    """Building a rule's tables is part of what the user waits for."""
    import time as clock
    from fastar.samplers import decoders

    model = tiny_model()
    real = decoders.make_rule
    monkeypatch.setattr(decoders, "make_rule", lambda *a: clock.sleep(0.3) or real(*a))
    _, stats = decode(model, tiny_conditioning(model), SamplingSettings(), DecoderSpec("gsd", window=4), seed=0)
    assert stats.setup_time_s >= 0.3 and stats.wall_time_s >= stats.setup_time_s + stats.forward_time_s


def test_stopwatch_on_a_gpu_records_events_and_waits_only_when_read(monkeypatch):
    """One host sync per decoding iteration is the rule: on CUDA a lap records an event on the stream (no
    wait); the phases are read from the events with one wait after the generation, and the wall time waits
    once. CUDA's Event, stream and synchronize are stood in for (no GPU here): the bookkeeping is real."""
    from fastar.samplers import stats as stats_module

    log, now = [], [0.0]

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream):
            now[0] += 1.5  # the device's timeline: 1.5 s per phase
            self.at = now[0]

        def elapsed_time(self, end):  # milliseconds, as CUDA's
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(stats_module.torch.cuda, "Event", Event)
    monkeypatch.setattr(stats_module.torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(stats_module.torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    watch = stats_module.Stopwatch(torch.device("cuda", 0))
    for phase in ("forward", "verify", "forward", "verify", "forward"):
        watch.lap(phase)
    assert log == []  # laps never wait
    assert watch.totals == {"forward": 4.5, "verify": 3.0} and log == ["sync"]
    assert watch.totals == {"forward": 4.5, "verify": 3.0} and log == ["sync"]  # read once
    watch.lap("verify")
    assert watch.totals["verify"] == 4.5 and log == ["sync", "sync"]
    watch.elapsed()
    assert log == ["sync"] * 3
    log.clear()
    cpu = stats_module.Stopwatch(torch.device("cpu"))
    cpu.lap("forward")
    assert cpu.totals["forward"] >= 0 and log == []


def test_gumbel_noise_is_fixed_per_position_whatever_the_window():
    from fastar.samplers.processing import counter_gumbel, counter_key

    key = counter_key(torch.Generator().manual_seed(0))
    wide = counter_gumbel(key, torch.arange(10, 20).view(1, 10).expand(3, 10), 7)
    narrow = counter_gumbel(key, torch.tensor([[15, 16], [15, 16], [15, 16]]), 7)
    assert torch.equal(wide[:, 5:7], narrow)
    assert not torch.equal(wide[0], wide[1])  # each row its own stream
    other = counter_gumbel(counter_key(torch.Generator().manual_seed(1)), torch.arange(10, 20).view(1, 10), 7)
    assert not torch.equal(wide[:1], other)
    # Gumbel(0, 1): mean is Euler's constant, standard deviation pi / sqrt(6)
    many = counter_gumbel(key, torch.arange(40000).view(2, 20000), 5)
    assert abs(many.mean().item() - 0.5772) < 0.02 and abs(many.std().item() - 1.2825) < 0.02


def test_gumbel_coupling_keeps_no_noise_for_the_whole_image():
    from fastar.samplers.token_loops.drafts import DraftSource

    source = DraftSource("random", "gumbel", batch=8, drafts=31, grid=(32, 32), vocab=16384,
                         generator=torch.Generator().manual_seed(0))
    assert not [name for name, value in vars(source).items()
                if isinstance(value, torch.Tensor) and value.numel() > 8 * 32 * 16384]


@pytest.mark.parametrize("decoder", ["ar", "sjd", "gsd"])
def test_same_seed_same_tokens_other_seed_other_tokens(decoder):
    model = tiny_model()
    cond = tiny_conditioning(model)
    spec = DecoderSpec(decoder, window=5, init="vertical", coupling="gumbel", group=3)
    a, _ = decode(model, cond, SamplingSettings(cfg_scale=3.0), spec, seed=7)
    b, _ = decode(model, cond, SamplingSettings(cfg_scale=3.0), spec, seed=7)
    c, _ = decode(model, cond, SamplingSettings(cfg_scale=3.0), spec, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("window", [2, 6, 40])
def test_stats_account_for_every_token(window):
    model = tiny_model()
    cond = tiny_conditioning(model)
    codes, stats = decode(model, cond, SamplingSettings(), DecoderSpec("sjd", window=window), seed=0)
    N = model.cfg.num_tokens
    assert codes.shape == (2, N) and codes.min() >= 0 and codes.max() < model.vocab_size
    per_row = torch.tensor(stats.fixed_per_forward).sum(0)
    assert per_row.tolist() == [N - 1, N - 1]  # token 0 comes from the prefill
    assert stats.target_forwards == len(stats.fixed_per_forward) == max(stats.row_forwards)
    assert max(max(it) for it in stats.fixed_per_forward) <= window
    for row in stats.fixed_at:  # raster order: a token is never fixed before the one on its left
        assert row[0] == 0 and all(a <= b for a, b in zip(row, row[1:]))
    json_stats = stats.to_json()
    for key in ("decoder", "tokens", "target_forwards", "step_compression", "fixed_per_forward", "wall_time_s"):
        assert key in json_stats
    assert json_stats["step_compression"] == pytest.approx(N / stats.target_forwards)


def test_window_and_choices_are_checked():
    model = tiny_model()
    cond = tiny_conditioning(model)
    for spec in (DecoderSpec("sjd", window=1), DecoderSpec("sjd", init="diagonal"),
                 DecoderSpec("sjd", coupling="loose"), DecoderSpec("gsd", group=0), DecoderSpec("nope")):
        with pytest.raises(FastARError):
            decode(model, cond, SamplingSettings(), spec, seed=0)


def test_rows_of_a_batch_advance_independently():
    """Greedy Jacobi with copy initialisation is deterministic, so each row must produce the same
    codes in the same number of forwards whether it runs alone or beside another row."""
    model = tiny_model(seed=3)
    cond = tiny_conditioning(model)
    settings = SamplingSettings(cfg_scale=2.0, temperature=0.0)
    spec = DecoderSpec("sjd", window=6, init="horizontal")
    both, stats = decode(model, cond, settings, spec, seed=0)
    solo = [decode(model, type(cond)(cond.labels[i : i + 1]), settings, spec, seed=0) for i in range(2)]
    for i, (codes, solo_stats) in enumerate(solo):
        assert torch.equal(both[i], codes[0])
        assert stats.row_forwards[i] == solo_stats.target_forwards
    assert stats.row_forwards[0] != stats.row_forwards[1]
    assert stats.target_forwards == max(stats.row_forwards)


@pytest.mark.parametrize("vocab, half", [(512, 5), (8, 10), (64, 1)])
def test_gsd_clusters_are_the_codes_ranked_around_the_draft(vocab, half):
    """The cluster by two top-k selections equals the definition by sorting: x and the codes at ranks
    rank(x) - half .. rank(x) + half of p, those that exist, in rank order."""
    from fastar.samplers.token_loops.acceptance import rank_neighbours

    generator = torch.Generator().manual_seed(vocab)
    p = torch.randn(3, 7, vocab, generator=generator).softmax(-1)
    x = torch.randint(0, vocab, (3, 7), generator=generator)
    x[0, 0], x[0, 1] = p[0, 0].argmax(), p[0, 1].argmin()  # the ends of the ranking
    members, exists = rank_neighbours(p, x, half)
    order = p.argsort(-1, descending=True)
    for b in range(3):
        for j in range(7):
            rank = int((order[b, j] == x[b, j]).nonzero())
            expected = [int(order[b, j, r]) for r in range(rank - half, rank + half + 1) if 0 <= r < vocab]
            assert members[b, j][exists[b, j]].tolist() == expected
