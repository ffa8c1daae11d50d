"""Bellman: values against the linear solve, iteration within the contraction bound, optimal values against
every deterministic policy; a wrong Bellman backup is caught; bad inputs; the page."""
import pytest
import torch

from backend import experiments
from backend.experiments.rl.bellman import BellmanConfig
from backend.rl.bellman import (MDP, Grid, best_deterministic_policy, grid_mdp, mrp_iterate, mrp_solve,
                                policy_iteration, value_iteration)
from tests.sweep import assert_refused, one_at_a_time, render_recorded


@pytest.mark.parametrize("settings_", one_at_a_time(BellmanConfig))
def test_defaults_and_each_layout_pass(settings_):
    result = experiments.run("rl.bellman", **settings_)
    assert result.passed, [c for c in result.checks if not c.passed]


def test_two_state_chain_by_hand():
    """P = [[0.5, 0.5], [0, 1]], R = [1, 0], γ = 0.5: V(1) = 0, V(0) = 1 + 0.25 V(0) → 4/3."""
    P = torch.tensor([[0.5, 0.5], [0.0, 1.0]], dtype=torch.float64)
    R = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert torch.allclose(mrp_solve(P, R, 0.5), torch.tensor([4 / 3, 0.0], dtype=torch.float64))
    assert abs(mrp_iterate(P, R, 0.5, 60)[-1][0] - 4 / 3) < 1e-15


def test_optimal_values_equal_exhaustive_search_on_random_mdps():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        P = torch.rand(3, 5, 5, generator=g, dtype=torch.float64)
        mdp = MDP(P / P.sum(-1, keepdim=True), torch.randn(5, 3, generator=g, dtype=torch.float64), 0.9)
        best = best_deterministic_policy(mdp, list(range(5)))
        V_pi = policy_iteration(mdp)[0]
        V_vi = value_iteration(mdp, 1e-12, 10_000)[0]
        assert (best - V_pi).abs().max() < 1e-10 and (best - V_vi).abs().max() < 1e-9


def test_a_wrong_backup_fails_the_optimality_check():
    """Value iteration with a mean over actions instead of the max evaluates the uniform policy, not V*."""
    mdp, _ = grid_mdp(Grid(["..G", ".#P", "..."]), -0.04, 0.2, 0.99)
    V = torch.zeros(mdp.R.shape[0], dtype=torch.float64)
    for _ in range(5000):
        V = mdp.q(V).mean(1)
    assert mdp.optimality_residual(V) > 1e-2


def test_slippery_grid_values_drop():
    free = grid_mdp(Grid(["..G", ".#P", "..."]), -0.04, 0.0, 0.99)[0]
    slippery = grid_mdp(Grid(["..G", ".#P", "..."]), -0.04, 0.4, 0.99)[0]
    assert (policy_iteration(slippery)[0] <= policy_iteration(free)[0] + 1e-12).all()


@pytest.mark.parametrize("values, field", [
    ({"transitions": "0.5,0.6; 0.5,0.5"}, "transitions"), ({"transitions": "1"}, "transitions"),
    ({"transitions": "a,b;c,d"}, "transitions"), ({"transitions": "0.5,0.5;" * 60}, "transitions"),
    ({"rewards": "1, 2"}, "rewards"), ({"gamma": "1.0"}, "gamma"), ({"layout": "10x10"}, "layout"),
])
def test_bad_inputs_name_the_field(values, field):
    assert_refused(BellmanConfig, values, field)


def test_page_draws_a_run():
    render_recorded("pages/bellman.py", "rl.bellman", episodes="200", layout="3x3")


def _bars_off(values: list[dict]) -> float:
    """The largest gap between the values table's Monte Carlo bar and pandas' mean ∓ two standard errors."""
    import pandas as pd

    v = pd.DataFrame(values)
    return float(max((v["mc_low"] - (v["monte_carlo"] - 2 * v["mc_stderr"])).abs().max(),
                     (v["mc_high"] - (v["monte_carlo"] + 2 * v["mc_stderr"])).abs().max()))


def test_the_monte_carlo_bars_come_from_the_result_and_old_runs_gain_them(monkeypatch):
    """The page draws the Monte Carlo values ± 2 standard errors from the result (pages only draw): equal to pandas'
    arithmetic; a version 1 run gains them by the upgrade; bars of one standard error fail."""
    from backend.experiments.rl import bellman as exp_bellman
    from backend.result import VERSION_KEY

    result = experiments.run("rl.bellman", episodes=200)
    assert _bars_off(result.tables["values"]) < 1e-12
    stored = result.to_dict()
    for row in stored["tables"]["values"]:
        del row["mc_low"], row["mc_high"]
    del stored[VERSION_KEY]  # stored before the bars: version 1
    assert _bars_off(exp_bellman.RESULT.upgrade(stored)["tables"]["values"]) < 1e-12

    def one_error(values):
        for r in values:
            r["mc_low"], r["mc_high"] = r["monte_carlo"] - r["mc_stderr"], r["monte_carlo"] + r["mc_stderr"]
        return values
    monkeypatch.setattr(exp_bellman, "monte_carlo_bars", one_error)
    assert _bars_off(exp_bellman.RESULT.upgrade(stored)["tables"]["values"]) > 1e-6
    assert _bars_off(experiments.run("rl.bellman", episodes=200).tables["values"]) > 1e-6
