"""`cadence sim plan`: the fewest replicas (and which engine options) that meet latency SLOs.

For each combination of the engine options on the grid, the replica count is searched by doubling
until the SLOs hold, then by bisection between the last count that failed and the first that
held (latency falls as replicas are added, so the boundary is where the two meet). The cheapest
configuration is the one with the fewest replicas; ties go to the lower p95 TTFT.

When the cost profile carries a validation (sim/real ratios measured against real runs, see
`cadence.sim.fidelity`), the cheapest configuration is searched once more with each objective
tightened by how optimistic the simulator was at the low end of those ratios: the raw count is
what the simulator says, the safe count what still holds if the real run is that far off.

With `disaggregate`, the same traffic is also planned on P/D fleets (sim/disagg.py): for each
total count, splits into P prefill and D decode replicas (every split up to 8 replicas; above,
the splits at fixed shares of prefill, `PD_SHARES`), the total searched by doubling then
bisection on "some split meets the SLOs", with the engine options of the cheapest colocated
configuration. The cheapest split is the one with the fewest replicas; ties go to the lower p95
TTFT. The validation's margin applies to the colocated count only.

Requests the engine refuses outright (400: longer than max_model_len) cannot be helped by more
replicas: they are reported, not counted against the SLOs. Any other failure (429 from a full
queue, a passed deadline) fails the configuration unless `max_error_rate` allows it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from cadence.bench import report
from cadence.config import EngineConfig, option_flags
from cadence.executor.cost_model import SpecAcceptance, StepCostModel, StepFeatures
from cadence.sim.fidelity import Validation, safe_bound
from cadence.sim.pd import PDOptions
from cadence.sim.simulator import SimOptions, Simulator, sim_max_model_len
from cadence.wording import counted
from cadence.workload import Workload

PLAN_METRICS = ("ttft", "itl", "tpot", "e2e", "queue")
# Shares of a P/D fleet's replicas that prefill, tried at each total above `ALL_SPLITS_UP_TO`.
PD_SHARES = (1 / 8, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4, 7 / 8)
ALL_SPLITS_UP_TO = 8


@dataclass(frozen=True)
class Objective:
    """`metric`'s q-th percentile over the run must be at most `bound` seconds."""

    metric: str
    q: int
    bound: float

    @property
    def key(self) -> str:
        return f"{self.metric}_p{self.q}"

    @classmethod
    def parse(cls, spec: str) -> Objective:
        """'ttft_p95=1.0' -> Objective('ttft', 95, 1.0)."""
        name, sep, value = spec.partition("=")
        metric, _, pq = name.strip().lower().rpartition("_p")
        try:
            q, bound = int(pq), float(value)
        except ValueError:
            q, bound = -1, math.nan
        if not sep or metric not in PLAN_METRICS or q not in report.PERCENTILES or not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"--slo {spec!r}: expected METRIC_pQ=SECONDS, METRIC in {PLAN_METRICS}, "
                             f"Q in {report.PERCENTILES}, e.g. ttft_p95=1.0")
        return cls(metric, q, bound)

    def value(self, summary: dict) -> float | None:
        return summary["overall"][self.metric][f"p{self.q}"]


@dataclass
class Trial:
    options: dict[str, Any]
    replicas: int
    values: dict[str, float | None]
    refused: int  # 400s: never servable, whatever the fleet
    failed: int  # every other unsuccessful request
    requests: int
    meets: bool
    wall_s: float
    margin: bool = False  # judged against the objectives tightened by the profile's validation
    split: tuple[int, int] | None = None  # a P/D fleet's (prefill, decode) replicas
    ttft_p95: float | None = None

    @property
    def fleet(self) -> str:
        """The configuration's replicas in words."""
        if self.split is None:
            return f"{self.replicas} replica{'s' if self.replicas > 1 else ''}"
        return f"{self.split[0]} prefill + {self.split[1]} decode = {self.replicas} replicas"


@dataclass
class PlanResult:
    objectives: list[Objective]
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    floor: dict[str, float] = field(default_factory=dict)  # unloaded prefill time percentiles
    notes: list[str] = field(default_factory=list)
    validation: Validation | None = None
    safe_objectives: list[Objective] = field(default_factory=list)  # tightened by the validation
    safe: Trial | None = None  # the cheapest configuration's count under safe_objectives
    disaggregated: bool = False  # P/D fleets were searched too
    pd_best: Trial | None = None  # the cheapest P/D split (with `disaggregated`)


def unloaded_ttft(workload: Workload, config: EngineConfig, model: StepCostModel,
                  max_model_len: int | None = None) -> list[float]:
    """Each request's time to first token on an idle engine: its prefill chunks back to back.
    No fleet can beat it, so an SLO below its percentile is infeasible. Requests longer than
    `max_model_len` are refused (400) and left out, as the objectives leave them out."""
    budget = config.scheduler.max_num_batched_tokens
    cap = config.scheduler.long_prefill_token_threshold or budget
    chunk = min(budget, cap)
    out = []
    for r in workload.requests:
        if max_model_len is not None and r.prompt_tokens + r.output_tokens > max_model_len:
            continue
        t, start = 0.0, 0
        while start < r.prompt_tokens:
            n = min(chunk, r.prompt_tokens - start)
            last = start + n >= r.prompt_tokens
            f = StepFeatures(prefill_tokens=n if n > 1 else 0, prefill_seqs=1 if n > 1 else 0,
                             decode_seqs=1 if n == 1 else 0, sampled=1 if last else 0,
                             decode_context=start + 1 if n == 1 else 0,
                             prefill_attention=n * start + n * (n + 1) // 2 if n > 1 else 0)
            t += model.predict(f)
            start += n
        out.append(t)
    return out


def evaluate(workload: Workload, config: EngineConfig, model: StepCostModel, replicas: int,
             objectives: list[Objective], *, router: str, max_model_len: int | None, seed: int,
             max_error_rate: float, options: dict[str, Any], pd: PDOptions | None = None,
             spec_acceptance: SpecAcceptance | None = None, spec_draft_ratio: float | None = None) -> Trial:
    """One simulation judged against the objectives: `replicas` colocated, or the P/D fleet `pd`."""
    sim_options = SimOptions(replicas=replicas, router=router, max_model_len=max_model_len, seed=seed,
                             spec_acceptance=spec_acceptance, spec_draft_ratio=spec_draft_ratio)
    if pd is None:
        sim = Simulator(config, model, sim_options)
    else:
        from cadence.sim.disagg import PDSimulator

        sim = PDSimulator(config, model, sim_options, pd)
    res = sim.run(workload)
    servable = [r for r in res.records if r.status != 400]
    summary = report.summarize(servable, {})
    failed = sum(1 for r in servable if not r.ok)
    values = {o.key: o.value(summary) for o in objectives}
    meets = (failed <= max_error_rate * max(1, len(servable))
             and all(v is not None and v <= o.bound for o, v in zip(objectives, values.values(), strict=True)))
    return Trial(options, len(sim.replicas), values, len(res.records) - len(servable), failed, len(res.records), meets,
                 res.wall_s, split=None if pd is None else (pd.prefill_replicas, pd.decode_replicas),
                 ttft_p95=summary["overall"]["ttft"]["p95"])


def min_replicas(run, max_replicas: int, start: int = 1) -> tuple[Trial | None, list[Trial]]:
    """Smallest n in [start, max_replicas] with run(n).meets, by doubling then bisection; every
    count below `start` is known to fail."""
    trials: list[Trial] = []
    lo, hi, n = start - 1, None, start  # lo: largest known failing count
    while n <= max_replicas:
        t = run(n)
        trials.append(t)
        if t.meets:
            hi = t
            break
        lo = n
        if n == max_replicas:
            break
        n = min(2 * n, max_replicas)
    if hi is None:
        return None, trials
    while hi.replicas - lo > 1:
        mid = (lo + hi.replicas) // 2
        t = run(mid)
        trials.append(t)
        if t.meets:
            hi = t
        else:
            lo = mid
    return hi, trials


def pd_splits(n: int) -> list[int]:
    """Prefill replicas to try in a P/D fleet of `n` (the rest decode): all up to ALL_SPLITS_UP_TO, else
    the shares of PD_SHARES."""
    if n < 2:
        return []
    if n <= ALL_SPLITS_UP_TO:
        return list(range(1, n))
    return sorted({min(n - 1, max(1, round(n * share))) for share in PD_SHARES})


def _pd_better(a: Trial, b: Trial) -> bool:
    """Whether split `a` beats `b` at the same total: meeting the SLOs, then the lower p95 TTFT."""
    inf = math.inf
    return (not a.meets, a.ttft_p95 if a.ttft_p95 is not None else inf) < \
        (not b.meets, b.ttft_p95 if b.ttft_p95 is not None else inf)


def search_disaggregated(workload: Workload, config: EngineConfig, model: StepCostModel,
                         objectives: list[Objective], *, link: PDOptions, router: str, max_replicas: int,
                         max_model_len: int | None, seed: int, max_error_rate: float, options: dict[str, Any],
                         progress: Any = None) -> tuple[Trial | None, list[Trial]]:
    """The cheapest P/D split meeting the objectives (see the module docstring), and every trial."""
    tried: list[Trial] = []

    def best_split(n: int) -> Trial:
        best: Trial | None = None
        for p in pd_splits(n):
            pd = PDOptions(p, n - p, link.kv_transfer_bandwidth, link.kv_transfer_latency_ms)
            t = evaluate(workload, config, model, n, objectives, router=router, max_model_len=max_model_len,
                         seed=seed, max_error_rate=max_error_rate, options=options, pd=pd)
            tried.append(t)
            if progress is not None:
                progress(t)
            if best is None or _pd_better(t, best):
                best = t
        assert best is not None
        return best

    if max_replicas < 2:
        return None, tried
    best, _ = min_replicas(best_split, max_replicas, start=2)
    return best, tried


def plan(workload: Workload, config: EngineConfig, model: StepCostModel, objectives: list[Objective], *,
         grid: dict[str, list[Any]] | None = None, router: str = "least-loaded", max_replicas: int = 64,
         max_model_len: int | None = None, seed: int = 0, max_error_rate: float = 0.0,
         progress: Any = None, disaggregate: PDOptions | None = None,
         spec_acceptance: SpecAcceptance | None = None, spec_draft_ratio: float | None = None) -> PlanResult:
    """Search the grid of engine options x replica counts; with `disaggregate` (its link's bandwidth
    and latency; its counts are searched), P/D splits too. `spec_acceptance`, `spec_draft_ratio`: how
    a speculating engine's drafts are accepted and a draft model's time priced (see `SimOptions`). See the module docstring."""
    if not objectives:
        raise ValueError("--slo: give at least one objective, e.g. --slo ttft_p95=1.0")
    result = PlanResult(list(objectives), validation=Validation.from_profile(model.metadata))
    floor = unloaded_ttft(workload, config, model, sim_max_model_len(max_model_len, model)) or [0.0]
    result.floor = {f"ttft_p{q}": report.percentile(floor, q) for q in report.PERCENTILES}
    for o in objectives:
        if o.metric == "ttft" and result.floor[o.key] > o.bound:
            result.notes.append(f"{o.key} <= {o.bound:g}s is infeasible: even on an idle engine the prefill alone "
                                f"gives {o.key} = {result.floor[o.key]:.3f}s; more replicas cannot help")
            return result
    names = sorted(grid or {})
    combos = list(itertools.product(*((grid or {})[k] for k in names))) if names else [()]
    for combo in combos:
        opts = dict(zip(names, combo, strict=True))
        cfg = config.replace(**opts) if opts else config

        def run(n: int, cfg: EngineConfig = cfg, opts: dict = opts) -> Trial:
            t = evaluate(workload, cfg, model, n, objectives, router=router, max_model_len=max_model_len,
                         seed=seed, max_error_rate=max_error_rate, options=opts, spec_acceptance=spec_acceptance,
                         spec_draft_ratio=spec_draft_ratio)
            if progress is not None:
                progress(t)
            return t

        best, trials = min_replicas(run, max_replicas)
        result.trials += trials
        if best is not None and (result.best is None or _cheaper(best, result.best, objectives)):
            result.best = best
    if result.best is None:
        result.notes.append(f"no configuration met the SLOs with up to {max_replicas} replicas")
    elif result.validation is not None:
        _search_safe(result, workload, config, model, router=router, max_replicas=max_replicas,
                     max_model_len=max_model_len, seed=seed, max_error_rate=max_error_rate, progress=progress,
                     spec_acceptance=spec_acceptance, spec_draft_ratio=spec_draft_ratio)
    if disaggregate is not None:
        result.disaggregated = True
        opts = result.best.options if result.best is not None else {}
        cfg = config.replace(**opts) if opts else config
        result.pd_best, trials = search_disaggregated(
            workload, cfg, model, objectives, link=disaggregate, router=router, max_replicas=max_replicas,
            max_model_len=max_model_len, seed=seed, max_error_rate=max_error_rate, options=opts, progress=progress)
        result.trials += trials
        if result.pd_best is None:
            result.notes.append(f"no P/D split met the SLOs with up to {max_replicas} replicas")
    return result


def _search_safe(result: PlanResult, workload: Workload, config: EngineConfig, model: StepCostModel, *,
                 router: str, max_replicas: int, max_model_len: int | None, seed: int, max_error_rate: float,
                 progress: Any, spec_acceptance: SpecAcceptance | None = None,
                 spec_draft_ratio: float | None = None) -> None:
    """The cheapest configuration's count under objectives tightened by the profile's validation.
    It is at least the raw count: a count that misses an objective misses a tighter one too."""
    assert result.best is not None and result.validation is not None
    v = result.validation
    result.safe_objectives = [Objective(o.metric, o.q, safe_bound(o.bound, v.spread_for(o.metric, o.q)))
                              for o in result.objectives]
    best = result.best
    if all(s.bound == o.bound for s, o in zip(result.safe_objectives, result.objectives, strict=True)):
        result.safe = best  # the simulator was not optimistic on these metrics: nothing to add
        return
    opts = best.options
    cfg = config.replace(**opts) if opts else config

    def run(n: int) -> Trial:
        t = replace(evaluate(workload, cfg, model, n, result.safe_objectives, router=router,
                             max_model_len=max_model_len, seed=seed, max_error_rate=max_error_rate, options=opts,
                             spec_acceptance=spec_acceptance, spec_draft_ratio=spec_draft_ratio),
                    margin=True)
        if progress is not None:
            progress(t)
        return t

    result.safe, trials = min_replicas(run, max_replicas, start=best.replicas)
    result.trials += trials
    if result.safe is None:
        result.notes.append(f"with the validation's margin no count up to {max_replicas} meets the SLOs")


def _cheaper(a: Trial, b: Trial, objectives: list[Objective]) -> bool:
    first = objectives[0].key
    return (a.replicas, a.values[first] or 0.0) < (b.replicas, b.values[first] or 0.0)


def format_trial(t: Trial, objectives: list[Objective]) -> str:
    opts = " ".join(f"{k}={v}" for k, v in t.options.items()) or "(engine options as given)"
    if t.margin:
        opts += " +margin"
    if t.split is not None:
        opts = f"{t.split[0]}P{t.split[1]}D " + opts
    vals = "".join(f"{'n/a' if t.values[o.key] is None else format(t.values[o.key], '.3f'):>12}" for o in objectives)
    return f"{opts:<48}{t.replicas:>9}{vals}{t.failed:>8}{'yes' if t.meets else 'no':>6}{t.wall_s:>8.1f}"


def format_header(objectives: list[Objective]) -> str:
    """The SLO line and the column heads of the table `format_trial` rows go under."""
    head = f"{'engine options':<48}{'replicas':>9}" + "".join(f"{o.key + ' s':>12}" for o in objectives) + \
        f"{'failed':>8}{'meets':>6}{'sim s':>8}"
    return "SLOs: " + ", ".join(f"{o.key} <= {o.bound:g}s" for o in objectives) + "\n" + head


def format_plan(result: PlanResult, with_table: bool = True) -> str:
    """The plan's report; `with_table=False` leaves out the SLOs and the tried rows (for a caller
    that printed them as they were tried)."""
    objs = result.objectives
    floor = "unloaded floor: " + ", ".join(f"{k} {v:.3f}s" for k, v in result.floor.items() if k.startswith("ttft"))
    lines = [floor]
    if with_table:
        slos, head = format_header(objs).split("\n")
        lines = [slos, floor, head, *(format_trial(t, objs) for t in result.trials)]
    if result.trials and result.trials[0].refused:
        lines.append(f"note: {counted(result.trials[0].refused, 'request')} refused by any fleet (longer than max_model_len); "
                     "they are left out of the SLOs")
    lines += [f"note: {n}" for n in result.notes]
    if result.best is not None:
        lines.append(("cheapest colocated: " if result.disaggregated else "cheapest: ") + _cheapest(result.best, objs))
        lines.append(_safe_line(result))
    if result.disaggregated:
        lines.append("cheapest P/D: " + (_cheapest(result.pd_best, objs) if result.pd_best is not None else "none found"))
        lines.append(_verdict(result))
    return "\n".join(lines)


def _cheapest(t: Trial, objectives: list[Objective]) -> str:
    opts = " ".join(" ".join(option_flags(k, v)) for k, v in t.options.items())
    return (f"{t.fleet}{(' with ' + opts) if opts else ''} ("
            + ", ".join(f"{o.key} {t.values[o.key]:.3f}s" for o in objectives) + ")")


def _verdict(result: PlanResult) -> str:
    """Whether to disaggregate, for this traffic: the fewer replicas win, then the lower p95 TTFT."""
    c, d = result.best, result.pd_best
    if c is None and d is None:
        return "disaggregate: unknown (neither meets the SLOs)"
    if c is None or d is None:
        return "disaggregate: yes (only P/D meets the SLOs)" if c is None else "disaggregate: no (only colocated meets the SLOs)"
    if d.replicas != c.replicas:
        fewer = d.replicas < c.replicas
        return (f"disaggregate: {'yes' if fewer else 'no'} ({d.replicas} P/D replicas against {c.replicas} colocated)")
    pd_ttft, co_ttft = d.ttft_p95 or math.inf, c.ttft_p95 or math.inf
    return (f"disaggregate: {'yes' if pd_ttft < co_ttft else 'no'} (the same {c.replicas} replicas; p95 TTFT "
            f"{pd_ttft:.3f}s P/D against {co_ttft:.3f}s colocated)")


def _safe_line(result: PlanResult) -> str:
    """The count with the validation's margin, or why there is none."""
    v = result.validation
    if v is None:
        return ("safe: no margin: the profile carries no validation, so the count assumes the simulator is exact "
                "(benchmarks/sim_fidelity.py --record-validation measures it)")
    tightened = ", ".join(f"{s.key} <= {s.bound:.3g}s simulated" for s, o in
                          zip(result.safe_objectives, result.objectives, strict=True) if s.bound < o.bound)
    if result.safe is None:
        return f"safe: none found ({tightened}); {v.describe()}"
    n = result.safe.replicas
    why = f"with {tightened}" if tightened else "the simulator was not optimistic on these metrics"
    return f"safe: {n} replica{'s' if n > 1 else ''} ({why}); {v.describe()}"
