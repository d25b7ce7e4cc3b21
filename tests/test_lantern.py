"""LANTERN's pieces in isolation: latent neighbourhoods B_k, the TV-bounded set A_{k,delta}, the relaxed
acceptance, the distorted-target residual and the greedy variant (decoders.md, LANTERN)."""
import pytest
import torch

from fastar.errors import FastARError
from fastar.samplers.token_loops.acceptance import ExactRule, LanternRule
from fastar.samplers.token_loops.latent_neighbours import latent_neighbours
from fastar.samplers.decoders import DecoderSpec


def random_setup(seed=0, V=24, D=4, batch=(5, 3)):
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(V, D, generator=g)
    p = torch.softmax(torch.randn(*batch, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(*batch, V, generator=g) * 2, -1)
    x = torch.randint(V, batch, generator=g)
    return codebook, p, q, x


def test_neighbours_are_sorted_by_latent_distance_with_the_code_itself_first():
    codebook, *_ = random_setup()
    codebook[7] = codebook[3]  # a duplicate code must not displace code 3 from its own first column
    table = latent_neighbours(codebook, 6).long()
    assert table.shape == (24, 6)
    assert torch.equal(table[:, 0], torch.arange(24))
    assert table[3, 1] == 7 and table[7, 1] == 3
    distances = (codebook[table] - codebook[:, None]).norm(dim=-1)
    assert (distances.diff(dim=-1) >= -1e-6).all()
    brute = torch.cdist(codebook, codebook).topk(6, largest=False).values
    assert torch.allclose(distances[:, 1:].sort(-1).values, brute[:, 1:], atol=1e-5)


def test_neighbour_tables_are_cached_per_codebook_and_k_is_capped():
    codebook, *_ = random_setup()
    assert latent_neighbours(codebook, 5) is latent_neighbours(codebook.clone(), 5)
    assert latent_neighbours(codebook, 5) is not latent_neighbours(codebook + 1, 5)
    assert latent_neighbours(codebook, 1000).shape == (24, 24)
    with pytest.raises(FastARError, match="k 0"):
        latent_neighbours(codebook, 0)


@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_distorted_target_moves_exactly_the_set_a_onto_the_draft_within_the_budget(delta):
    codebook, p, _, x = random_setup(1)
    table = latent_neighbours(codebook, 10)
    rule = LanternRule(table, delta)
    distorted = rule.distorted(p, x)
    tv = 0.5 * (distorted - p).abs().sum(-1)
    assert (tv < delta).all()  # the per-token bound of the paper
    assert torch.allclose(distorted.sum(-1), torch.ones_like(tv))
    members, mass, in_a = rule.neighbourhood(p, x)
    # A is the longest prefix of the nearest neighbours whose mass stays below delta: the next one breaks it
    first_out = in_a.long().sum(-1)
    assert torch.equal(in_a, torch.arange(9) < first_out.unsqueeze(-1))
    broken = first_out < 9
    next_mass = mass.cumsum(-1).gather(-1, first_out.clamp(max=8).unsqueeze(-1)).squeeze(-1)
    assert (next_mass[broken] >= delta).all()
    assert torch.allclose(tv, (mass * in_a).sum(-1), atol=1e-6)
    assert (distorted.gather(-1, members)[in_a] == 0).all()


def test_relaxed_acceptance_is_at_least_exact_and_grows_with_delta():
    codebook, p, q, x = random_setup(2)
    table = latent_neighbours(codebook, 8)
    exact = ExactRule().accept_probability(p, q, x)
    previous = exact
    for delta in (0.0, 0.05, 0.2, 0.6):
        accept = LanternRule(table, delta).accept_probability(p, q, x)
        assert (accept >= previous - 1e-7).all()
        previous = accept
    assert torch.allclose(LanternRule(table, 0.0).accept_probability(p, q, x), exact)
    assert (previous > exact + 1e-3).any()


def test_residual_is_the_positive_part_of_distorted_target_minus_draft():
    codebook, p, q, x = random_setup(3, batch=(6,))
    rule = LanternRule(latent_neighbours(codebook, 6), 0.3)
    residual = rule.residual(p, q, x)
    expected = (rule.distorted(p, x) - q).clamp_min(0)
    assert torch.allclose(residual, expected / expected.sum(-1, keepdim=True), atol=1e-6)
    assert torch.allclose(LanternRule(rule.neighbours, 0.0).residual(p, q, x), ExactRule().residual(p, q, x))


def test_codes_outside_the_target_support_are_never_accepted_nor_resampled():
    """The issue's counterexample: x = 0 has p(x) = 0 (cut by top-k); its neighbour 1 would fit in A at delta 0.1,
    and moving A's mass onto x would let the residual draw the excluded code."""
    p, q, x = torch.tensor([[0.0, 0.05, 0.95]]), torch.tensor([[0.01, 0.5, 0.49]]), torch.tensor([0])
    rule = LanternRule(torch.tensor([[0, 1, 2], [1, 0, 2], [2, 1, 0]]), 0.1)
    assert rule.accept_probability(p, q, x).item() == 0
    assert torch.equal(rule.distorted(p, x), p)
    assert torch.allclose(rule.residual(p, q, x), torch.tensor([[0.0, 0.0, 1.0]]))
    codebook, p, q, x = random_setup(4, batch=(8,))
    p = p.scatter(-1, x.unsqueeze(-1), 0.0)
    p = p / p.sum(-1, keepdim=True)
    for greedy in (False, True):
        rule = LanternRule(latent_neighbours(codebook, 24), 0.9, greedy=greedy)
        assert (rule.accept_probability(p, q, x) == 0).all()
        assert (rule.residual(p, q, x).gather(-1, x.unsqueeze(-1)) == 0).all()


def test_greedy_accepts_exactly_when_the_draft_is_the_argmax_of_the_distorted_target():
    codebook, p, _, _ = random_setup(5, batch=(400,))
    table = latent_neighbours(codebook, 8)
    rule = LanternRule(table, 0.3, greedy=True)
    x = torch.randint(24, (400,), generator=torch.Generator().manual_seed(9))
    one_hot = torch.nn.functional.one_hot(x, 24).float()
    accept = rule.accept_probability(p, one_hot, x)
    assert torch.equal(accept.bool(), rule.distorted(p, x).argmax(-1) == x)
    assert accept.sum() > (p.argmax(-1) == x).sum()  # the relaxation accepts non-argmax drafts
    rejected = ~accept.bool()
    assert torch.equal(rule.residual(p, one_hot, x)[rejected].argmax(-1), p.argmax(-1)[rejected])


def test_out_of_range_delta_is_refused():
    for delta in (1.5, -0.1):
        with pytest.raises(FastARError, match="LANTERN delta .* out of range: use 0..1"):
            DecoderSpec("lantern", lantern_delta=delta).validate()


@pytest.mark.parametrize("lam", [1.5, 2.0, 4.0])
def test_lambda_bounds_the_relaxed_probability_by_a_multiple_of_the_drafts_own(lam):
    """LANTERN++: A is the longest run of the nearest neighbours whose mass stays within (lambda - 1) p(x), so the
    relaxed probability p(x) + p(A) is at most lambda p(x); lambda 1 is exact; the next neighbour breaks the bound."""
    codebook, p, q, x = random_setup(6)
    table = latent_neighbours(codebook, 10)
    rule = LanternRule(table, lam=lam)
    members, mass, in_a = rule.neighbourhood(p, x)
    p_x = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)
    relaxed = p_x + (mass * in_a).sum(-1)
    assert (relaxed <= lam * p_x * (1 + 1e-6)).all() and (relaxed > p_x).any()
    first_out = in_a.long().sum(-1)
    broken = first_out < 9
    next_mass = mass.cumsum(-1).gather(-1, first_out.clamp(max=8).unsqueeze(-1)).squeeze(-1)
    assert (next_mass[broken] > (lam - 1) * p_x[broken]).all()
    assert rule.name == f"lantern++ (lambda {lam:g})"
    exact = LanternRule(table, lam=1.0).accept_probability(p, q, x)
    assert torch.allclose(exact, ExactRule().accept_probability(p, q, x))


def test_out_of_range_lambda_is_refused():
    with pytest.raises(FastARError, match="lambda 0.5 is out of range"):
        DecoderSpec("lantern", lantern_lambda=0.5).validate()
    DecoderSpec("lantern", lantern_lambda=0.0).validate()  # off
