"""rl.bellman: seed 000's weather Markov chain as a Markov reward process, its state values by the Bellman
expectation equation solved directly and by iteration (with the error per iteration against γ^k), and by Monte
Carlo returns; a grid-world MDP with policy evaluation, policy iteration and value iteration, the optimal policy
drawn, checked against the linear solve, the Bellman optimality residual and (small grids) every policy.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.result import Check, Result, Schema, error_bars
from backend.rl.bellman import (ARROWS, MOVES, Grid, best_deterministic_policy, grid_mdp, monte_carlo_values,
                                mrp_iterate, mrp_solve, policy_evaluation, policy_iteration, value_iteration)

WEATHER = ("sunny", "cloudy", "rainy", "snowy", "foggy", "windy")
LAYOUTS = {
    "4x3 (Russell & Norvig)": ["...G", ".#.P", "...."],
    "3x3": ["..G", ".#P", "..."],
    "5x5 with pits": ["....G", ".#P..", ".....", "..P#.", "....."],
}
EXHAUSTIVE_LIMIT = 4 ** 7  # policies searched one by one only on small grids (each is a linear solve)
TOL = 1e-10
WALK_STEP_S = 0.18e-6  # one Monte Carlo walk's step (a multinomial draw from a row of P), all walks batched: 11.7 s of CPU for 82.5M measured


def parse_matrix(text: str) -> list[list[float]]:
    """Rows separated by ';', entries by ','; a stochastic matrix of 2..6 states."""
    if len(text) > 300:
        raise ConfigError("transitions", f"{len(text)} characters (allowed: at most 300)")
    try:
        rows = [[float(v) for v in row.split(",")] for row in text.split(";") if row.strip()]
    except ValueError:
        raise ConfigError("transitions", f"{text!r} is not rows of numbers (allowed: e.g. 0.9,0.1; 0.5,0.5)") from None
    n = len(rows)
    if not 2 <= n <= len(WEATHER) or any(len(r) != n for r in rows):
        raise ConfigError("transitions", f"not a square matrix of 2..{len(WEATHER)} states (allowed: n rows of n entries)")
    if any(not 0 <= v <= 1 for r in rows for v in r) or any(abs(sum(r) - 1) > 1e-9 for r in rows):
        raise ConfigError("transitions", "each row must be probabilities summing to 1 (allowed: entries in 0..1, row sums 1)")
    return rows


@dataclasses.dataclass
class BellmanConfig(Config):
    transitions: str = setting("0.7,0.2,0.1; 0.3,0.4,0.3; 0.2,0.4,0.4",
                               help="weather chain P[s, s'] (sunny, cloudy, rainy, ...): rows ';', entries ','")
    rewards: tuple[float, ...] = setting([1.0, 0.0, -1.0], item_range=(-100, 100), length=(2, len(WEATHER)),
                                         help="reward R_s of a day in each state")
    gamma: float = setting(0.9, min=0.0, max=0.99, help="MRP discount γ")
    iterations: int = setting(100, min=1, max=2000, help="Bellman iterations V ← R + γPV shown")
    episodes: int = setting(2000, min=100, max=20000, help="Monte Carlo walks per state")
    layout: str = setting("4x3 (Russell & Norvig)", choices=tuple(LAYOUTS), help="grid world (G +1 and P -1 end it, # wall)")
    step_reward: float = setting(-0.04, min=-1.0, max=1.0, help="reward for entering any other cell")
    slip: float = setting(0.2, min=0.0, max=1.0, help="probability the move goes to a side instead (half each)")
    grid_gamma: float = setting(0.99, min=0.0, max=0.99, help="grid-world discount γ")
    seed: int = setting(0, min=0, max=2**31 - 1, help="Monte Carlo walks")

    cost_drivers = ("episodes", "gamma", "iterations")

    def horizon(self) -> int:
        """Steps a Monte Carlo walk is followed: until γ^t < 1e-6 (its tail is then negligible)."""
        return max(1, math.ceil(math.log(1e-6) / math.log(self.gamma))) if self.gamma > 0 else 1

    def estimate(self):
        """Monte Carlo dominates: `episodes` walks from each state, `horizon` steps each, all walks moved at once per
        step; the grid worlds converge in under 3,000 sweeps of a few ops (under 0.2 s measured)."""
        walks = len(parse_matrix(self.transitions)) * self.episodes
        return cost(data_bytes=walks * 300, ops=self.horizon() * 10 + self.iterations * 5 + 5000,
                    seconds=walks * self.horizon() * WALK_STEP_S)

    def check(self) -> None:
        n = len(parse_matrix(self.transitions))
        if len(self.rewards) != n:
            raise ConfigError("rewards", f"{len(self.rewards)} rewards for {n} states (allowed: one per state, each in -100..100)")


def markov_reward_process(c: BellmanConfig) -> tuple[dict, list[Check]]:
    P = torch.tensor(parse_matrix(c.transitions), dtype=torch.float64)
    R = torch.tensor(c.rewards, dtype=torch.float64)
    V = mrp_solve(P, R, c.gamma)
    iterates = mrp_iterate(P, R, c.gamma, c.iterations)
    start = float(V.abs().max())  # ||V_0 - V|| with V_0 = 0
    convergence = [{"iteration": k, "error": float((v - V).abs().max()), "bound": c.gamma ** k * start} for k, v in enumerate(iterates)]
    horizon = c.horizon()
    mc, se = monte_carlo_values(P, R, c.gamma, c.episodes, horizon, torch.Generator().manual_seed(c.seed))
    names = WEATHER[:len(P)]
    values = [{"state": names[s], "reward": float(R[s]), "linear_solve": float(V[s]), "iteration": float(iterates[-1][s]),
               "monte_carlo": float(mc[s]), "mc_stderr": float(se[s])} for s in range(len(P))]
    z = float(((mc - V).abs() / se.clamp(min=1e-12)).max())
    checks = [
        Check("MRP: linear solve satisfies V = R + γPV", float((R + c.gamma * P @ V - V).abs().max()), TOL,
              reference="the Bellman expectation equation, substituted back"),
        Check("MRP: every iterate within the contraction bound γ^k·||V*||", max(r["error"] - r["bound"] for r in convergence), 1e-12,
              reference="Banach fixed point: V ← R + γPV is a γ-contraction", detail="largest (error - bound)"),
        Check("MRP: Monte Carlo returns agree with the solve", z, 4.0,
              reference=f"mean discounted return of {c.episodes} walks per state, cut at {horizon} steps",
              detail="largest |difference| in standard errors"),
    ]
    return {"values": monte_carlo_bars(values), "convergence": convergence, "transition": [
        {"from": names[i], "to": names[j], "p": float(P[i, j])} for i in range(len(P)) for j in range(len(P))]}, checks


def grid_world(c: BellmanConfig) -> tuple[dict, list[Check], dict]:
    grid = Grid(LAYOUTS[c.layout])
    mdp, cells = grid_mdp(grid, c.step_reward, c.slip, c.grid_gamma)
    n, a = mdp.R.shape
    uniform = torch.full((n, a), 1.0 / a, dtype=torch.float64)
    V_iter, deltas = policy_evaluation(mdp, uniform, TOL * (1 - c.grid_gamma), 100_000)
    V_uniform = mrp_solve(*mdp.induced(uniform), c.grid_gamma)
    V_pi, policy, pi_history = policy_iteration(mdp)
    V_vi, policy_vi, residuals = value_iteration(mdp, TOL, 100_000)
    V_greedy = mrp_solve(*mdp.induced(policy_vi), c.grid_gamma)
    decisions = [s for s, cell in enumerate(cells) if grid.kind(cell) == "."]
    checks = [
        Check("policy evaluation (iterative) of the uniform policy equals the linear solve of P^π, R^π",
              float((V_iter - V_uniform).abs().max()), 1e-8, reference="(I - γP^π)^-1 R^π, P^π = Σ_a π(a|s)P^a"),
        Check("policy iteration and value iteration reach the same V*", float((V_pi - V_vi).abs().max()), 1e-8,
              reference="two algorithms"),
        Check("Bellman optimality residual ||max_a q(s,a) - V*(s)|| of policy iteration's V*", mdp.optimality_residual(V_pi), 1e-9,
              reference="V* is the unique fixed point of the optimality equation"),
        Check("value iteration's greedy policy, evaluated by linear solve, attains V*", float((V_greedy - V_pi).abs().max()), 1e-8,
              reference="linear solve of the greedy policy's MRP"),
    ]
    exhaustive = a ** len(decisions)
    if exhaustive <= EXHAUSTIVE_LIMIT:
        best = best_deterministic_policy(mdp, decisions)
        checks.append(Check(f"V* equals the best of all {exhaustive} deterministic policies", float((best - V_pi).abs().max()), 1e-8,
                            reference="every policy's values by linear solve, best per state"))
    names = list(MOVES)
    q = mdp.q(V_pi)
    board = []
    for r, line in enumerate(grid.rows):
        for col, ch in enumerate(line):
            s = cells.index((r, col)) if ch != "#" else None
            board.append({"row": r, "col": col, "kind": {"#": "wall", "G": "goal", "P": "pit", ".": "free"}[ch],
                          "value": None if s is None else float(V_pi[s]),
                          "uniform_value": None if s is None else float(V_uniform[s]),
                          "action": ARROWS[names[int(policy[s].argmax())]] if ch == "." else {"G": "+1", "P": "−1", "#": ""}[ch],
                          **({f"q_{m}": float(q[s, i]) for i, m in enumerate(names)} if ch == "." else {})})
    tables = {"board": board, "policy_iteration": pi_history,
              "value_iteration": [{"iteration": k + 1, "residual": r} for k, r in enumerate(residuals)],
              "policy_evaluation": [{"iteration": k + 1, "update": d} for k, d in enumerate(deltas)]}
    metrics = {"policy_iteration_steps": len(pi_history), "value_iteration_steps": len(residuals),
               "policy_evaluation_steps": len(deltas), "exhaustive_policies": exhaustive if exhaustive <= EXHAUSTIVE_LIMIT else None}
    return tables, checks, metrics


def run(config: BellmanConfig, ctx) -> Result:
    torch.set_num_threads(1)
    mrp_tables, mrp_checks = markov_reward_process(config)
    ctx.progress(0.4, "grid world")
    grid_tables, grid_checks, grid_metrics = grid_world(config)
    values = mrp_tables["values"]
    return Result(
        metrics={**{f"V.{v['state']}": v["linear_solve"] for v in values}, **grid_metrics},
        tables={**mrp_tables, **grid_tables}, checks=mrp_checks + grid_checks,
        notes=["The seed draws its weather chain as a figure whose numbers are not in its text; the default matrix "
               "and rewards here are an example to edit.",
               f"Exhaustive search over deterministic policies runs when there are at most {EXHAUSTIVE_LIMIT} of them."])


def monte_carlo_bars(values: list[dict]) -> list[dict]:
    """Each state's Monte Carlo value two standard errors either side (about 95 % of such intervals hold the true
    value): the bar the page draws beside the linear solve."""
    return error_bars(values, "monte_carlo", "mc_stderr", 2, "mc_low", "mc_high")


RESULT = Schema(
    metrics=(
        "V.sunny", "V.cloudy", "V.rainy", "policy_iteration_steps", "value_iteration_steps",
        "policy_evaluation_steps", "exhaustive_policies",
    ),
    tables={
        "values": ("iteration", "linear_solve", "mc_stderr", "monte_carlo", "reward", "state", "mc_low", "mc_high"),
        "convergence": ("bound", "error", "iteration"),
        "transition": ("from", "p", "to"),
        "board": ("action", "col", "kind", "q_down", "q_left", "q_right", "q_up", "row", "uniform_value", "value"),
        "policy_iteration": ("actions_changed", "iteration", "mean_value"),
        "value_iteration": ("iteration", "residual"),
        "policy_evaluation": ("iteration", "update"),
    },
    version=2, upgrades={1: lambda result: monte_carlo_bars(result["tables"]["values"])},  # v1: the page computed the bars
)

EXPERIMENT = define(__name__, BellmanConfig,
                    "weather MRP by linear solve, iteration and Monte Carlo; grid-world policy evaluation, policy and value iteration",
                    run_fn=run, schema=RESULT)
