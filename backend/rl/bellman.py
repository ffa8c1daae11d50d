"""Markov reward and decision processes and the Bellman equations (seed 000), in float64 torch.

MRP <S, P, R, γ>:   V = R + γ P V, so V = (I - γ P)^-1 R (a linear solve), or iterate V_{k+1} = R + γ P V_k,
                    a γ-contraction: ||V_k - V|| ≤ γ^k ||V_0 - V||.
MDP <S, A, P, R, γ>: P[a, s, s'], R[s, a] (expected reward of a in s). A policy π[s, a] turns it into an MRP,
                    P^π = Σ_a π(a|s) P^a, R^π = Σ_a π(a|s) R^a (the seed's formulas), so its values are one
                    linear solve. q(s, a) = R(s, a) + γ Σ_s' P(s'|s, a) V(s'). Optimal: V*(s) = max_a q*(s, a).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def mrp_solve(P: torch.Tensor, R: torch.Tensor, gamma: float) -> torch.Tensor:
    return torch.linalg.solve(torch.eye(len(R), dtype=P.dtype) - gamma * P, R)


def mrp_iterate(P: torch.Tensor, R: torch.Tensor, gamma: float, iterations: int) -> list[torch.Tensor]:
    """V_0 = 0, V_{k+1} = R + γ P V_k; returns V_0 .. V_iterations."""
    values = [torch.zeros_like(R)]
    for _ in range(iterations):
        values.append(R + gamma * P @ values[-1])
    return values


def monte_carlo_values(P: torch.Tensor, R: torch.Tensor, gamma: float, episodes: int, horizon: int,
                       g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """V(s) = E[G_t | S_t = s] by sampling: mean and standard error of the discounted return over `episodes`
    walks from each state, cut at `horizon` (the tail is at most γ^horizon·max|R|/(1-γ))."""
    n = len(R)
    state = torch.arange(n).repeat_interleave(episodes)
    ret = torch.zeros(len(state), dtype=P.dtype)
    for t in range(horizon):
        ret += gamma ** t * R[state]  # R_s = E[R_{t+1} | S_t = s], received on leaving s
        state = torch.multinomial(P[state], 1, generator=g)[:, 0]
    ret = ret.view(n, episodes)
    return ret.mean(1), ret.std(1) / episodes ** 0.5


# --- MDPs -------------------------------------------------------------------------------------------
@dataclass
class MDP:
    P: torch.Tensor  # (actions, states, states)
    R: torch.Tensor  # (states, actions)
    gamma: float

    def induced(self, policy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """P^π[s, s'] = Σ_a π(a|s) P^a[s, s'], R^π[s] = Σ_a π(a|s) R[s, a]."""
        return torch.einsum("sa,ast->st", policy, self.P), (policy * self.R).sum(1)

    def q(self, V: torch.Tensor) -> torch.Tensor:
        return self.R + self.gamma * torch.einsum("ast,t->sa", self.P, V)

    def greedy(self, V: torch.Tensor) -> torch.Tensor:
        """A deterministic policy (one-hot rows) taking the first best action."""
        return torch.nn.functional.one_hot(self.q(V).argmax(1), self.R.shape[1]).to(self.R.dtype)

    def optimality_residual(self, V: torch.Tensor) -> float:
        """||max_a q(s, a) - V(s)||_∞: zero exactly at the optimal values."""
        return float((self.q(V).max(1).values - V).abs().max())


def policy_evaluation(mdp: MDP, policy: torch.Tensor, tol: float, max_iterations: int) -> tuple[torch.Tensor, list[float]]:
    """Iterative policy evaluation, V ← R^π + γ P^π V, until the update is below tol; returns V and the update sizes."""
    P, R = mdp.induced(policy)
    V, deltas = torch.zeros_like(R), []
    for _ in range(max_iterations):
        new = R + mdp.gamma * P @ V
        deltas.append(float((new - V).abs().max()))
        V = new
        if deltas[-1] < tol:
            break
    return V, deltas


def policy_iteration(mdp: MDP, max_iterations: int = 100) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """Evaluate the policy exactly (linear solve), improve greedily, until the policy stops changing."""
    n, a = mdp.R.shape
    policy = torch.full((n, a), 1.0 / a, dtype=mdp.R.dtype)
    history = []
    for it in range(max_iterations):
        V = mrp_solve(*mdp.induced(policy), mdp.gamma)
        improved = mdp.greedy(V)
        history.append({"iteration": it, "actions_changed": int((improved.argmax(1) != policy.argmax(1)).sum()) if it else n,
                        "mean_value": float(V.mean())})
        if it and torch.equal(improved, policy):
            break
        policy = improved
    return V, policy, history


def value_iteration(mdp: MDP, tol: float, max_iterations: int) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """V ← max_a [R + γ P V] until the update is below tol (1-γ)/(2γ), so the greedy policy's values are within tol."""
    V, residuals = torch.zeros(mdp.R.shape[0], dtype=mdp.R.dtype), []
    for _ in range(max_iterations):
        new = mdp.q(V).max(1).values
        residuals.append(float((new - V).abs().max()))
        V = new
        if residuals[-1] < tol * (1 - mdp.gamma) / (2 * mdp.gamma):
            break
    return V, mdp.greedy(V), residuals


def best_deterministic_policy(mdp: MDP, decision_states: list[int], chunk: int = 16384) -> torch.Tensor:
    """Exhaustive search: the values of every deterministic policy over decision_states (others take action 0),
    each by a linear solve; returns the element-wise best values (an optimal policy attains all at once)."""
    n, a = mdp.R.shape
    total = a ** len(decision_states)
    best = torch.full((n,), -torch.inf, dtype=mdp.R.dtype)
    eye = torch.eye(n, dtype=mdp.R.dtype)
    digits = a ** torch.arange(len(decision_states))
    for lo in range(0, total, chunk):
        codes = torch.arange(lo, min(lo + chunk, total))
        actions = torch.zeros(len(codes), n, dtype=torch.long)
        actions[:, decision_states] = (codes[:, None] // digits) % a
        P = mdp.P.permute(1, 0, 2)[torch.arange(n), actions]                    # (policies, s, s')
        R = mdp.R[torch.arange(n), actions]                                     # (policies, s)
        V = torch.linalg.solve(eye - mdp.gamma * P, R)
        best = torch.maximum(best, V.max(0).values)
    return best


# --- a grid world -----------------------------------------------------------------------------------
MOVES = {"up": (-1, 0), "right": (0, 1), "down": (1, 0), "left": (0, -1)}
ARROWS = {"up": "↑", "right": "→", "down": "↓", "left": "←"}


@dataclass
class Grid:
    rows: list[str]  # '.' free, '#' wall, 'G' goal (+1, ends), 'P' pit (-1, ends)

    def cells(self) -> list[tuple[int, int]]:
        return [(r, c) for r, line in enumerate(self.rows) for c, ch in enumerate(line) if ch != "#"]

    def kind(self, cell: tuple[int, int]) -> str:
        return self.rows[cell[0]][cell[1]]


def grid_mdp(grid: Grid, step_reward: float, slip: float, gamma: float) -> tuple[MDP, list[tuple[int, int]]]:
    """Actions move one cell; with probability slip the move goes to either side instead (half each); walls and
    edges keep the agent in place. Entering G pays +1, P pays -1, any other cell step_reward. G and P absorb
    with reward 0 after."""
    cells = grid.cells()
    index = {cell: i for i, cell in enumerate(cells)}
    n, names = len(cells), list(MOVES)
    P = torch.zeros(len(names), n, n, dtype=torch.float64)
    R = torch.zeros(n, len(names), dtype=torch.float64)
    reward = {"G": 1.0, "P": -1.0}

    def land(cell, move):
        target = (cell[0] + move[0], cell[1] + move[1])
        return index.get(target, index[cell])

    for cell, s in index.items():
        for a, name in enumerate(names):
            if grid.kind(cell) in "GP":
                P[a, s, s] = 1.0
                continue
            side = names[(a + 1) % 4], names[(a + 3) % 4]
            for move, prob in ((MOVES[name], 1 - slip), (MOVES[side[0]], slip / 2), (MOVES[side[1]], slip / 2)):
                t = land(cell, move)
                P[a, s, t] += prob
                R[s, a] += prob * reward.get(grid.kind(cells[t]), step_reward)
    return MDP(P, R, gamma), cells
