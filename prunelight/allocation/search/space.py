"""The space of level assignments: which levels each sub-block may take, their cost, the budget window, the
moves between them, the first generation's seeds and the final removal."""

from __future__ import annotations

import random
from dataclasses import dataclass

from prunelight.allocation.budget import Budget, Removed, build_plan, empty_removed, plan_params_removed
from prunelight.allocation.search.levels import KINDS, Levels, LevelsDatabase
from prunelight.allocation.served import best_per_count
from prunelight.allocation.served import candidates as served_candidates
from prunelight.allocation.stock import candidates as uniform_candidates
from prunelight.allocation.width import global_width, uniform_counts

@dataclass
class LevelSpace:
    """Which levels each sub-block may take, their parameter cost and the budget window."""

    budget: Budget
    step: int  # MLP channels per level
    limits: dict[str, list[int]]  # most units removable per sub-block (a multiple of step for the MLP)
    fixed_attn: bool = False  # moves change MLP levels only (the served layout: attention comes from its seeds)

    @classmethod
    def of(cls, budget: Budget, mlp_levels: int, align: int = 1, fixed_attn: bool = False) -> LevelSpace:
        """Levels from the budget's limits: every group count, MLP widths every 1/mlp_levels (x align)."""
        width = max(budget.n_chans) if budget.n_chans else 1
        step = max(1, int(round(width / mlp_levels)))
        step = max(align, int(round(step / align)) * align) if align > 1 else step
        lim = {"attn": list(budget.limits("attn")), "mlp": [(m // step) * step for m in budget.limits("mlp")]}
        return cls(budget, step, lim, fixed_attn)

    def cost(self, levels: Levels) -> int:
        """Unit parameters the assignment removes."""
        return sum(levels["attn"]) * self.budget.g_cost + sum(levels["mlp"]) * self.budget.c_cost

    @property
    def window(self) -> int:
        """Width of the budget window in parameters: one MLP level."""
        return self.step * self.budget.c_cost

    def within(self, levels: Levels) -> bool:
        """Whether the assignment is inside target <= cost < target + one MLP level, and inside the limits."""
        c = self.cost(levels)
        inside = all(0 <= levels[k][i] <= self.limits[k][i] for k in KINDS for i in range(len(levels[k])))
        return inside and self.budget.target <= c < self.budget.target + self.window

    def snap(self, removed_counts: Levels) -> Levels:
        """An assignment near the given removed counts per sub-block (MLP on the grid), repaired to the window."""
        out = {"attn": [min(a, lim) for a, lim in zip(removed_counts["attn"], self.limits["attn"])],
               "mlp": [min(int(round(m / self.step)) * self.step, lim)
                       for m, lim in zip(removed_counts["mlp"], self.limits["mlp"])]}
        lv = self.repair(out, random.Random(0))
        if lv is None and not self.fixed_attn:  # the MLP grid alone cannot give the rest: attention gives more
            lv = self._with_more_attention(out)
        return lv

    def _with_more_attention(self, levels: Levels) -> Levels | None:
        """`levels` with GQA groups added (one per sub-block in turn, first layers first) until the MLP grid can meet
        the budget, then repaired; None when even every group does not (the run plan's `check_search` refuses that)."""
        lv = {k: list(v) for k, v in levels.items()}
        most_mlp = sum(self.limits["mlp"]) * self.budget.c_cost
        while sum(lv["attn"]) * self.budget.g_cost + most_mlp < self.budget.target:
            room = [i for i, (a, lim) in enumerate(zip(lv["attn"], self.limits["attn"])) if a < lim]
            if not room:
                return None
            lv["attn"][min(room, key=lambda i: (lv["attn"][i], i))] += 1
        return self.repair(lv, random.Random(0))

    def repair(self, levels: Levels, rng: random.Random) -> Levels | None:
        """Move MLP levels of random sub-blocks until the cost is inside the window; None if it cannot."""
        lv = {k: list(v) for k, v in levels.items()}
        target, window = self.budget.target, self.window
        n = len(lv["mlp"])
        for _ in range(10 * sum(self.limits["mlp"]) // max(self.step, 1) + 10):
            c = self.cost(lv)
            if c < target:
                room = [i for i in range(n) if lv["mlp"][i] + self.step <= self.limits["mlp"][i]]
                if not room:
                    return None
                lv["mlp"][rng.choice(room)] += self.step
            elif c >= target + window:
                room = [i for i in range(n) if lv["mlp"][i] >= self.step]
                if not room:
                    return None
                lv["mlp"][rng.choice(room)] -= self.step
            else:
                return lv
        return None

    def mutate(self, levels: Levels, rng: random.Random, moves: int) -> Levels | None:
        """1..moves level moves: equal-cost swaps inside a kind, or a GQA group traded against the MLP (repaired)."""
        lv = {k: list(v) for k, v in levels.items()}
        for _ in range(rng.randint(1, moves)):
            kind = "mlp" if self.fixed_attn or not any(self.limits["attn"]) or rng.random() < 0.5 else "attn"
            unit = self.step if kind == "mlp" else 1
            ups = [i for i in range(len(lv[kind])) if lv[kind][i] + unit <= self.limits[kind][i]]
            downs = [i for i in range(len(lv[kind])) if lv[kind][i] >= unit]
            if not ups or not downs:
                continue
            up = rng.choice(ups)
            if kind == "attn" and rng.random() < 0.5:  # trade: one group more or less, the MLP repairs the budget
                if rng.random() < 0.5:
                    lv["attn"][up] += 1
                else:
                    lv["attn"][rng.choice(downs)] -= 1
                continue
            down = rng.choice([i for i in downs if i != up] or downs)
            if down == up:
                continue
            lv[kind][up] += unit
            lv[kind][down] -= unit
        return self.repair(lv, rng)

    def removed(self, levels: Levels, db: LevelsDatabase) -> Removed:
        """The units removed: each sub-block's first `levels` units of its order."""
        out = empty_removed(self.budget)
        for kind in KINDS:
            for i, r in enumerate(levels[kind]):
                if r:
                    out[kind][i] = set(db.blocks[(kind, i)].order[:r])
        return out


def counts_of(removed: Removed) -> Levels:
    """Per-sub-block removed counts of a removal."""
    return {k: [len(s) for s in removed[k]] for k in KINDS}


def finish(space: LevelSpace, levels: Levels, db: LevelsDatabase, align: int = 1) -> Removed:
    """The final removal: the assignment's units, then the last channels of the orders given back (one sub-block
    after another, most-removed first, `align` at a time) until target <= P < target + align x c_cost counting
    everything the plan removes."""
    budget = space.budget
    removed = space.removed(levels, db)
    total = plan_params_removed(budget, build_plan(budget, removed))
    excess = (total - budget.target) // (budget.c_cost * align)
    layers = sorted(range(budget.num_layers), key=lambda i: -len(removed["mlp"][i]))
    live = [i for i in layers if 0 < len(removed["mlp"][i]) < budget.n_chans[i]]
    k = 0
    while excess > 0 and live:
        i = live[k % len(live)]
        order = db.blocks[("mlp", i)].order
        r = len(removed["mlp"][i])
        if r > align:
            for j in order[r - align:r]:
                removed["mlp"][i].discard(j)
            excess -= 1
        else:
            live.remove(i)
            continue
        k += 1
    return removed



def seed_levels(space: LevelSpace, scores, plans: dict[str, Removed] | None = None) -> dict[str, Levels]:
    """The first generation: the uniform counts, global's knapsack on the criterion's scores, and `plans`."""
    budget = space.budget
    out: dict[str, Levels] = {}
    try:
        g, c = uniform_counts(budget)
        out["uniform"] = space.snap({"attn": [min(g, n) for n in budget.n_groups], "mlp": [c] * budget.num_layers})
    except ValueError:  # equal counts cannot meet this budget (aligned widths): the other seeds can
        pass
    out["global"] = space.snap(counts_of(global_width(scores, budget)))
    for name, removed in (plans or {}).items():
        out[name] = space.snap(counts_of(removed))
    return {k: v for k, v in out.items() if v is not None}


def served_seeds(space: LevelSpace, scores, align: int, plans: dict[str, Removed] | None = None
                 ) -> tuple[dict[str, Levels], list[dict]]:
    """The first generation under the served layout: for each kept group count, the served allocation's best
    layout (`served.best_per_count`), and its attention with the MLP widths of uniform, global and `plans`;
    with the served candidates (their report)."""
    free = seed_levels(space, scores, plans)
    cands = best_per_count(served_candidates(scores, space.budget, align))
    out: dict[str, Levels] = {}
    for c in cands:
        attn = counts_of(c["_removed"])["attn"]
        name = f"g{c['groups_kept']}" + (f"-{len(c['attention_removed_layers'])}" if c["attention_removed_layers"]
                                         else "")
        out[f"served {name}"] = space.snap(counts_of(c["_removed"]))
        for seed, lv in free.items():
            out[f"{seed} {name}"] = space.snap({"attn": attn, "mlp": lv["mlp"]})
    return {k: v for k, v in out.items() if v is not None}, [
        {k: v for k, v in c.items() if k != "_removed"} for c in cands]


def uniform_seeds(space: LevelSpace, scores, align: int) -> tuple[dict[str, Levels], list[dict]]:
    """Every uniform shape meeting the budget (`stock.candidates`) as an assignment, with the candidates."""
    budget = space.budget
    cands = uniform_candidates(scores, budget, align)
    n_c = budget.n_chans[0]
    out = {f"groups_removed={c['groups_removed_per_layer']}": {
        "attn": [c["groups_removed_per_layer"]] * budget.num_layers,
        "mlp": [n_c - c["intermediate_size"]] * budget.num_layers} for c in cands}
    return out, cands


