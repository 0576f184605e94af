"""Colocation control: from samples of usage and pressure to actions on best-effort slots (pure).

Online slots (guaranteed and burstable) come first; best-effort slots may use only what online work
leaves idle. :func:`decide` takes the loop's state and one :class:`Sample` and returns the next
state, the :class:`Action` list, what the period measured and the *batch* capacity (what online
slots hold but do not use, which best-effort work may use now). It does no I/O: the sampler
(:mod:`nodeagent.isolation.colocation_kernel`) reads the kernel, the actuator there and the agent's
loop carry the actions out, and the tests feed it recorded or invented series.

CPU. Best-effort runs on the shared pool only. Each period::

    online  = the burstable class's CPU time                            (the online slots in the pool)
    host    = busy time of the pool's CPUs - online - best-effort's      (everything else)
    basis   = max(online over the last cpu_release_periods periods)      (cut now, give back later)
    allowed = pool * (1 - cpu_margin) - basis, at least min_cpus

and the best-effort class gets ``floor(allowed)`` CPUs of the pool (at least one) as its cpuset and
``allowed`` CPUs of quota. The host's other use (tenants outside the agent, system daemons, the
agent itself, steal) is not online work: it competes with best-effort through the scheduler, where
best-effort runs at idle priority, so best-effort's allowance is what the online slots leave, not
what everything leaves (``host_cpu_as_online`` counts it as online instead; so does a period in
which the burstable class's CPU time could not be read). The CPUs come from the high end of the
pool in a fixed order, whole cores together, so best-effort sits still on a few CPUs and online
tasks find the others idle; a CPU whose hyperthread sibling runs busy online work (a guaranteed
slot's core, or a pool CPU outside best-effort's cpuset) is taken last. Online CPU or I/O
pressure (the share of the period in which an online task waited, from PSI) at or above its
threshold cuts best-effort to ``min_cpus`` at once and holds it there for ``cpu_release_periods``.
With two or more priorities among best-effort slots, each priority level gets as quota what the
levels above it leave (their use plus headroom).

Memory bandwidth. Where resctrl has MBA, best-effort's shared group holds its bandwidth share and
none of this applies. Where it has not but the CPU counts cache misses (``Sample.traffic_counted``),
CPU is the proxy: while online work runs (its peak over the release periods at least
``BANDWIDTH_ONLINE_CPUS``, or online pressure in that window), a slot whose traffic per
CPU-second of its own, times best-effort's CPU allowance, exceeds
``best_effort_bandwidth_mb_per_s`` is a *bandwidth hog*, and each of the N hogs gets the quota
that keeps it at 1/N of that budget::

    intensity = traffic / cpu                                           (bytes per CPU-second)
    hog       = intensity * allowed > budget   (> 0.8 * budget while already cut: no flapping)
    quota     = budget / N / intensity, at least min_cpus

Where resctrl exists, best-effort's shared group has the small share (``best_effort_l3_share``,
``best_effort_mb_percent``) while online work runs, by the same measure as above or online
pressure in the release window, and the default group's whole cache and bandwidth while it is
idle (``resctrl_narrow``, ``resctrl_wide``): in the first period of online load, and back after
``cpu_release_periods`` quiet periods.

Intensity does not fall when the slot is cut (its traffic falls with its CPU), so the cut holds
until the work changes or online work stops; a period in which a cut slot barely ran keeps its cut.

Memory. Node memory used at or above ``memory_throttle_percent`` holds every best-effort slot at
its current size (memory.high, the soft limit on v1); below the threshold by 5 points it is lifted.
At ``memory_evict_percent`` (or online memory pressure at ``memory_pressure_threshold``)
best-effort workers are evicted, lowest priority first and then youngest, until the projected use
is below ``memory_evict_target_percent`` (pressure alone evicts one per period). Evicted workers
come back one at a time, highest priority first, once memory has been calm for
``restore_after_seconds`` and their last size fits below the throttle threshold.

Online pressure is the worst of the online groups' per-cgroup PSI (cgroup v2). Where groups have no
PSI (cgroup v1) memory and I/O pressure are node-wide (which includes best-effort's own stalls, so
it errs towards protecting online work) and CPU pressure is not used: the node-wide CPU figure
counts best-effort tasks waiting for each other and cannot tell online stalls apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from nodeagent.isolation.colocation_types import (
    ACTION_KINDS,
    BURSTABLE_GROUP,
    Action,
    ActionKind,
    Batch,
    BestEffortSlot,
    ColocationConfig,
    CpuLimit,
    Decision,
    Eviction,
    GroupUsage,
    LoopState,
    Measured,
    PressureResource,
    Sample,
    Stall,
    WindowPoint,
)

#: Hysteresis below each memory threshold before its action is undone, in percentage points.
MEMORY_HYSTERESIS_POINTS = 5.0
#: Quota is written in hundredths of a CPU.
QUOTA_STEP = 0.01
#: A period that took longer than this many periods (a suspended host, a stalled loop) gives no rates.
MAX_PERIOD_FACTOR = 10.0
#: Headroom a priority level keeps above its use before lower levels get the rest.
PRIORITY_HEADROOM_FACTOR = 1.25
PRIORITY_HEADROOM_CPUS = 0.05
#: The least memory.high a throttled slot is held at (a slot this small costs nothing to keep).
THROTTLE_FLOOR_BYTES = 16 << 20
#: Online work at or above this many CPUs (its peak over the release periods) is what the
#: bandwidth proxy protects; below it best-effort's memory traffic is let be.
BANDWIDTH_ONLINE_CPUS = 0.1
#: A cut slot stays cut while its projected traffic is above this share of the budget.
BANDWIDTH_RELEASE_SHARE = 0.8
#: A slot's traffic per CPU-second is trusted from periods in which it used at least this much CPU.
BANDWIDTH_MIN_CPU = 0.01

# --------------------------------------------------------------------------- the decision


#: A period reads every best-effort slot's cgroup at least this often (the batch figures, and a
#: slot's usage for the next decision that needs it), and whenever :func:`needs_slot_detail` says so.
SLOT_DETAIL_EVERY = 30
#: Node memory this many points below where throttling would be let go already reads every slot.
SLOT_DETAIL_MARGIN_POINTS = 5.0


def needs_slot_detail(config: ColocationConfig, state: LoopState, sample: Sample, *, priorities: int) -> bool:
    """Whether this period's decision may need each best-effort slot's own usage: memory near the
    throttle line or online memory pressure (throttling and eviction pick slots by their size),
    slots throttled, evicted or under per-priority quotas (their release, restore and quotas),
    or ``priorities`` levels among best-effort slots of two or more (the quotas follow each
    slot's CPU use), or the memory bandwidth proxy at work (online work running and traffic
    counted). Otherwise the class totals decide it all: at 500 idle best-effort slots,
    reading two files of each every period was most of the agent's idle CPU (issue 23).

    ``sample`` is the period's sample before the slots are read (node and class figures)."""
    if state.throttled or state.evicted or state.slot_quota or priorities >= 2:
        return True
    if _bandwidth_watched(config, state, sample):
        return True  # the proxy needs each slot's traffic and CPU in consecutive periods
    line = config.memory_throttle_percent - MEMORY_HYSTERESIS_POINTS - SLOT_DETAIL_MARGIN_POINTS
    if _used_percent(sample) >= line:
        return True
    previous = state.previous
    dt = 0.0 if previous is None else sample.time - previous.time
    if previous is None or dt <= 0:
        return True
    pressure = _online_pressure(previous, sample, dt * 1e6).get("memory")
    return pressure is not None and pressure >= config.memory_pressure_threshold / 2


def decide(config: ColocationConfig, state: LoopState, sample: Sample) -> Decision:
    """The loop's next state and actions for ``sample`` (see the module docstring)."""
    previous = state.previous
    dt = 0.0 if previous is None else sample.time - previous.time
    rated = previous is not None and 0 < dt <= config.period_seconds * MAX_PERIOD_FACTOR
    actions: list[Action] = []
    measured: Measured | None = None
    batch: Batch | None = None
    if rated:
        assert previous is not None
        rates = _Rates.of(previous, sample, dt, host_as_online=config.host_cpu_as_online)
        state, cpu_actions, allowed = _cpu(config, state, sample, rates)
        actions += cpu_actions
        state, share_actions = _resctrl_share(state, sample)
        actions += share_actions
        state = _append_window(config, state, sample, rates)
        measured = Measured(
            period_seconds=dt,
            pool_cpus=len(sample.pool),
            pool_busy=rates.pool_busy,
            online_cpu=rates.online_cpu,
            best_effort_cpu=rates.best_effort_cpu,
            memory_used_percent=_used_percent(sample),
            online_pressure=rates.online_pressure,
            allowed_cpus=allowed,
            host_cpu=rates.host_cpu,
            best_effort_traffic=sum(rates.slot_traffic.values()) if rates.slot_traffic else None,
        )
        batch = _batch(config, state, sample, rates)
        pressure = rates.online_pressure.get("memory")
    else:
        # No rates this period (the first sample, or a gap): keep what is in force, reset the history.
        state = replace(state, recent_online_cpu=(), recent_pressure=())
        pressure = None
    state, memory_actions = _memory(config, state, sample, pressure)
    actions += memory_actions
    return Decision(replace(state, previous=sample), tuple(actions), measured, batch)


@dataclass(frozen=True)
class _Rates:
    busy: Mapping[int, float]  # per CPU, share of the period
    pool_busy: float
    best_effort_cpu: float
    online_cpu: float  # what counts as online (see the module docstring)
    host_cpu: float | None  # the pool's use by neither class; None: the online slots' is unknown
    online_pressure: Mapping[PressureResource, float | None]
    slot_cpu: Mapping[str, float]
    slot_traffic: Mapping[str, float]  # bytes/s, slots whose traffic both samples counted

    @classmethod
    def of(cls, before: Sample, now: Sample, dt: float, *, host_as_online: bool = False) -> _Rates:
        dt_ns = dt * 1e9
        busy = {
            cpu: max(0.0, (now.cpu_busy_ns[cpu] - before.cpu_busy_ns[cpu]) / dt_ns)
            for cpu in now.cpu_busy_ns
            if cpu in before.cpu_busy_ns
        }
        pool_busy = sum(busy.get(cpu, 0.0) for cpu in now.pool)
        best_effort = _rate(before.best_effort_cpu_ns, now.best_effort_cpu_ns, dt_ns) or 0.0
        slot_cpu: dict[str, float] = {}
        slot_traffic: dict[str, float] = {}
        if before.slots_read and now.slots_read:  # else no slot has two readings: every rate is 0
            old_slots = {s.slot_id: s for s in before.best_effort}
            slot_cpu = {
                s.slot_id: _rate(old_slots[s.slot_id].usage.cpu_ns, s.usage.cpu_ns, dt_ns) or 0.0
                for s in now.best_effort
                if s.slot_id in old_slots
            }
            if now.traffic_counted:
                for s in now.best_effort:
                    old = old_slots.get(s.slot_id)
                    traffic = (
                        None if old is None else _rate(old.memory_traffic_bytes, s.memory_traffic_bytes, dt)
                    )
                    if traffic is not None:
                        slot_traffic[s.slot_id] = traffic
        not_best_effort = max(0.0, pool_busy - best_effort)
        old_class, new_class = before.online.get(BURSTABLE_GROUP), now.online.get(BURSTABLE_GROUP)
        slots = (
            None
            if old_class is None or new_class is None
            else _rate(old_class.cpu_ns, new_class.cpu_ns, dt_ns)
        )
        # The class's own clock and /proc/stat's ticks disagree by a little: the slots never count
        # for more than the pool's use that is not best-effort's.
        slots = None if slots is None else min(slots, not_best_effort)
        host = None if slots is None else not_best_effort - slots
        return cls(
            busy=busy,
            pool_busy=pool_busy,
            best_effort_cpu=best_effort,
            online_cpu=not_best_effort if slots is None or host_as_online else slots,
            host_cpu=host,
            online_pressure=_online_pressure(before, now, dt * 1e6),
            slot_cpu=slot_cpu,
            slot_traffic=slot_traffic,
        )


def _rate(before: int | None, now: int | None, dt: float) -> float | None:
    if before is None or now is None:
        return None
    return max(0.0, (now - before) / dt)


def _online_pressure(before: Sample, now: Sample, dt_us: float) -> dict[PressureResource, float | None]:
    resources: tuple[PressureResource, ...] = ("cpu", "memory", "io")
    groups = [
        (before.online[name].stall, usage.stall)
        for name, usage in now.online.items()
        if name in before.online and usage.stall is not None and before.online[name].stall is not None
    ]
    found: dict[PressureResource, float | None] = {}
    if groups:
        for resource in resources:
            rates = [
                _rate(getattr(old, resource), getattr(new, resource), dt_us)
                for old, new in groups
                if old is not None and new is not None
            ]
            known = [r for r in rates if r is not None]
            found[resource] = max(known) if known else None
        return found
    # No per-group PSI (cgroup v1): node-wide memory and I/O; node-wide CPU cannot tell online apart.
    found["cpu"] = None
    for resource in ("memory", "io"):
        found[resource] = _rate(
            getattr(before.node_stall, resource), getattr(now.node_stall, resource), dt_us
        )
    return found


# --------------------------------------------------------------------------- CPU


def _cpu(
    config: ColocationConfig, state: LoopState, sample: Sample, rates: _Rates
) -> tuple[LoopState, list[Action], float]:
    pool = len(sample.pool)
    recent = (*state.recent_online_cpu, rates.online_cpu)[-config.cpu_release_periods :]
    hot = _pressure_reason(config, rates.online_pressure)
    recent_hot = (*state.recent_pressure, hot)[-config.cpu_release_periods :]
    state = replace(state, recent_online_cpu=recent, recent_pressure=recent_hot)
    if not pool:
        return state, [], 0.0
    basis = max(recent)
    allowed = pool * (1 - config.cpu_margin) - basis
    reason = (
        f"online work used {basis:.2f} of {pool} pool CPUs (peak of the last {len(recent)} periods); "
        f"{config.cpu_margin:.0%} kept free"
    )
    pressured = [r for r in recent_hot if r is not None]
    if pressured:
        allowed = config.min_cpus
        reason = (
            pressured[-1]
            if hot is not None
            else f"{pressured[-1]} (held for {config.cpu_release_periods} periods)"
        )
    allowed = min(float(pool), max(config.min_cpus, allowed))
    actions: list[Action] = []
    current = state.cpu_limit
    band = max(0.1, 0.05 * pool)
    count = max(1, math.floor(allowed + 1e-9))
    current_cpus = sample.pool if current is None else current.cpus
    tainted = _tainted(sample, rates, current_cpus, config.smt_busy_threshold)
    cpus = choose_cpus(sample.pool, sample.core_of, count, tainted)
    quota = _quantize(min(allowed, float(len(cpus))))
    if current is None or not current.cpus <= sample.pool:
        changed = True  # the first limit, or the pool moved under the one in force
    else:
        changed = (
            cpus != current.cpus
            or abs(quota - current.quota) >= band
            or (quota <= config.min_cpus < current.quota)
        )
    if changed:
        before = float(pool) if current is None else current.quota
        shrinking = quota < before or (current is not None and len(cpus) < len(current.cpus))
        kind: ActionKind = "cpu_suppress" if shrinking else "cpu_release"
        actions.append(Action(kind, None, reason, cpus=cpus, quota_cpus=quota))
        state = replace(state, cpu_limit=CpuLimit(cpus, quota))
    limit = state.cpu_limit
    assert limit is not None
    state, quota_actions = _slot_quotas(config, state, sample, rates, limit.quota)
    return state, actions + quota_actions, allowed


def _pressure_reason(
    config: ColocationConfig, pressure: Mapping[PressureResource, float | None]
) -> str | None:
    checks: tuple[tuple[PressureResource, float], ...] = (
        ("cpu", config.cpu_pressure_threshold),
        ("io", config.io_pressure_threshold),
    )
    for resource, threshold in checks:
        value = pressure.get(resource)
        if value is not None and value >= threshold:
            return f"online {resource} pressure {value:.0%} of the period (threshold {threshold:.0%})"
    return None


def _tainted(
    sample: Sample, rates: _Rates, best_effort_cpus: frozenset[int], threshold: float
) -> frozenset[int]:
    """Pool CPUs whose hyperthread sibling runs busy online work: exclusive CPUs, and pool CPUs
    outside best-effort's cpuset (only online work and the host run there)."""
    online_cpus = (sample.pool - best_effort_cpus) | sample.exclusive
    busy_cores = {
        sample.core_of[cpu]
        for cpu in online_cpus
        if cpu in sample.core_of and rates.busy.get(cpu, 0.0) >= threshold
    }
    return frozenset(
        cpu
        for cpu in sample.pool
        if sample.core_of.get(cpu) in busy_cores
        and any(
            other != cpu and sample.core_of.get(other) == sample.core_of[cpu] and other in online_cpus
            for other in sample.core_of
        )
    )


def choose_cpus(
    pool: frozenset[int], core_of: Mapping[int, int], count: int, tainted: frozenset[int] = frozenset()
) -> frozenset[int]:
    """``count`` CPUs of ``pool`` for best-effort (at least one): from the high end, a core's CPUs
    together, CPUs in ``tainted`` only when nothing else is left."""
    if not pool:
        return frozenset()
    cores: dict[int, list[int]] = {}
    for cpu in pool:
        cores.setdefault(core_of.get(cpu, -1 - cpu), []).append(cpu)
    ordered = [
        cpu
        for _, members in sorted(cores.items(), key=lambda kv: -max(kv[1]))
        for cpu in sorted(members, reverse=True)
    ]
    candidates = [cpu for cpu in ordered if cpu not in tainted] + [cpu for cpu in ordered if cpu in tainted]
    clean = [cpu for cpu in candidates if cpu not in tainted]
    chosen = clean[: max(0, count)] or candidates[:1]
    return frozenset(chosen)


def _slot_quotas(
    config: ColocationConfig, state: LoopState, sample: Sample, rates: _Rates, allowed: float
) -> tuple[LoopState, list[Action]]:
    """Each best-effort slot's own quota: what the priority levels above it leave, and the
    bandwidth proxy's cut (the smaller of the two where both apply)."""
    slots = [s for s in sample.best_effort if not s.evicted]
    levels = sorted({s.priority for s in slots}, reverse=True)
    caps = _bandwidth_caps(config, state, sample, rates, allowed=allowed, slots=slots)
    if len(levels) < 2 and not state.slot_quota and not caps:
        return state, []  # one priority, no hog and no quota to lift: nothing to do for any slot
    by_priority = _priority_quotas(config, rates, allowed, slots, levels)
    actions: list[Action] = []
    quotas = dict(state.slot_quota)
    present = {s.slot_id for s in sample.best_effort}
    for slot_id in list(quotas):
        if slot_id not in present:
            del quotas[slot_id]
    for slot in slots:
        wanted = [
            q for q in (by_priority.get(slot.slot_id), caps.get(slot.slot_id, (None, ""))[0]) if q is not None
        ]
        new = min(wanted) if wanted else None
        old = quotas.get(slot.slot_id)
        if new is None and old is None:
            continue
        if new is not None and old is not None and abs(new - old) < max(0.05, 0.1 * old):
            continue
        if slot.slot_id in caps and new == caps[slot.slot_id][0]:
            why = caps[slot.slot_id][1]
        elif new is not None:
            higher = [lv for lv in levels if lv > slot.priority]
            why = (
                f"priority {slot.priority}: what priorities {', '.join(map(str, higher))} leave of "
                f"{allowed:.2f} CPUs"
                if higher
                else f"priority {slot.priority}: the highest; may use all {allowed:.2f} CPUs"
            )
        else:
            why = "no priorities among best-effort slots and no memory bandwidth cut: quota lifted"
        actions.append(Action("slot_cpu_quota", slot.slot_id, why, quota_cpus=new))
        if new is None:
            quotas.pop(slot.slot_id, None)
        else:
            quotas[slot.slot_id] = new
    capped = {slot_id: quota for slot_id, (quota, _) in caps.items()}
    return replace(state, slot_quota=quotas, bandwidth_capped=capped), actions


def _priority_quotas(
    config: ColocationConfig,
    rates: _Rates,
    allowed: float,
    slots: list[BestEffortSlot],
    levels: list[int],
) -> dict[str, float]:
    """With two or more priorities, each level's quota is what the levels above leave."""
    wanted: dict[str, float] = {}
    if len(levels) < 2:
        return wanted
    remaining = allowed
    for level in levels:
        members = [s for s in slots if s.priority == level]
        for slot in members:
            wanted[slot.slot_id] = _quantize(max(config.min_cpus, remaining))
        use = sum(
            rates.slot_cpu.get(s.slot_id, 0.0) * PRIORITY_HEADROOM_FACTOR + PRIORITY_HEADROOM_CPUS
            for s in members
        )
        remaining = max(0.0, remaining - use)
    return wanted


# --------------------------------------------------------------------------- memory bandwidth


def _bandwidth_watched(config: ColocationConfig, state: LoopState, sample: Sample) -> bool:
    """Whether the bandwidth proxy is at work: traffic counted, a budget set, online work running
    (or a cut still in force)."""
    if not sample.traffic_counted or config.best_effort_bandwidth_mb_per_s <= 0:
        return False
    return bool(state.bandwidth_capped) or _online_active(state)


def _online_active(state: LoopState) -> bool:
    """Online work ran in the release window (the state already holds this period's figures)."""
    busy = max(state.recent_online_cpu, default=0.0) >= BANDWIDTH_ONLINE_CPUS
    return busy or any(reason is not None for reason in state.recent_pressure)


def _resctrl_share(state: LoopState, sample: Sample) -> tuple[LoopState, list[Action]]:
    """Best-effort's resctrl group: the small share while online work runs, the whole otherwise."""
    if not sample.resctrl_group:
        return state, []
    wide = not _online_active(state)
    if wide == state.resctrl_wide:
        return state, []
    if wide:
        action = Action(
            "resctrl_wide",
            None,
            f"online work idle for {len(state.recent_online_cpu)} periods: the default group's cache "
            "and memory bandwidth",
        )
    else:
        peak = max(state.recent_online_cpu, default=0.0)
        action = Action(
            "resctrl_narrow",
            None,
            f"online work running ({peak:.2f} CPUs at its peak): best-effort back to its small cache "
            "and memory bandwidth share",
        )
    return replace(state, resctrl_wide=wide), [action]


def _bandwidth_caps(
    config: ColocationConfig,
    state: LoopState,
    sample: Sample,
    rates: _Rates,
    *,
    allowed: float,
    slots: list[BestEffortSlot],
) -> dict[str, tuple[float, str]]:
    """The bandwidth hogs' quotas and why (see the module docstring); empty when online work is
    idle, traffic is not counted or the budget is 0."""
    budget = config.best_effort_bandwidth_mb_per_s * 1e6
    if budget <= 0 or not sample.traffic_counted:
        return {}
    if not _online_active(state):
        return {}  # the cuts end with online work (its peak over the release periods)
    hogs: dict[str, float | None] = {}
    for slot in slots:
        cpu = rates.slot_cpu.get(slot.slot_id, 0.0)
        traffic = rates.slot_traffic.get(slot.slot_id)
        cut = state.bandwidth_capped.get(slot.slot_id)
        if traffic is None or cpu < BANDWIDTH_MIN_CPU:
            if cut is not None:
                hogs[slot.slot_id] = None  # barely ran (or unread): its cut stands
            continue
        line = budget * (BANDWIDTH_RELEASE_SHARE if cut is not None else 1.0)
        if traffic / cpu * allowed > line:
            hogs[slot.slot_id] = traffic / cpu
    caps: dict[str, tuple[float, str]] = {}
    for slot_id, intensity in hogs.items():
        if intensity is None:
            caps[slot_id] = (
                state.bandwidth_capped[slot_id],
                "memory bandwidth hog (cut kept: it barely ran)",
            )
            continue
        quota = max(config.min_cpus, _quantize(budget / len(hogs) / intensity))
        caps[slot_id] = (
            quota,
            f"memory traffic {intensity / 1e6:.0f} MB per CPU-second: {allowed:.2f} CPUs of it would be "
            f"{intensity * allowed / 1e6:.0f} MB/s, over best-effort's {budget / 1e6:g} MB/s while online "
            f"work runs ({len(hogs)} slot(s) share it; the host has no MBA to cap bandwidth itself)",
        )
    return caps


def _quantize(cpus: float) -> float:
    return round(math.floor(cpus / QUOTA_STEP + 1e-9) * QUOTA_STEP, 2)


# --------------------------------------------------------------------------- memory


def _used_percent(sample: Sample) -> float:
    if sample.memory_total <= 0:
        return 0.0
    return 100.0 * (1 - sample.memory_available / sample.memory_total)


def _memory(
    config: ColocationConfig, state: LoopState, sample: Sample, pressure: float | None
) -> tuple[LoopState, list[Action]]:
    total = sample.memory_total
    if total <= 0:
        return state, []
    slots = {s.slot_id: s for s in sample.best_effort}
    # The agent is the record of which workers it stopped; keep what the loop knows of those only.
    evicted = {sid: e for sid, e in state.evicted.items() if sid in slots and slots[sid].evicted}
    used = total - sample.memory_available
    # Memory of evicted workers still charged is on its way out (or reclaimable cache).
    leaving = sum(slots[sid].usage.memory_bytes or 0 for sid in evicted)
    used_pct = 100.0 * max(0, used - leaving) / total
    actions: list[Action] = []
    throttled = dict(state.throttled)
    for slot_id in list(throttled):
        if slot_id not in slots or slots[slot_id].evicted:
            del throttled[slot_id]
    throttle_at = config.memory_throttle_percent
    calm_below = throttle_at - MEMORY_HYSTERESIS_POINTS
    if used_pct >= throttle_at:
        for slot in sample.best_effort:
            size = slot.usage.memory_bytes
            if slot.slot_id in throttled or slot.evicted or size is None:
                continue
            high = max(size, THROTTLE_FLOOR_BYTES)
            if slot.memory_high is not None and slot.memory_high <= high:
                continue  # its own limit already holds it there
            throttled[slot.slot_id] = high
            actions.append(
                Action(
                    "memory_throttle",
                    slot.slot_id,
                    f"node memory {used_pct:.0f}% used (throttle at {throttle_at:g}%): held at its "
                    "current size",
                    memory_high=high,
                )
            )
    elif used_pct < calm_below:
        for slot_id in sorted(throttled):
            base = slots[slot_id].memory_high
            actions.append(
                Action(
                    "memory_unthrottle",
                    slot_id,
                    f"node memory {used_pct:.0f}% used (below {calm_below:g}%): its own limit again",
                    memory_high=base,
                )
            )
        throttled = {}
    evictions = _evictions(config, sample, evicted, used_pct, pressure)
    for action in evictions:
        assert action.slot_id is not None
        evicted[action.slot_id] = Eviction(sample.time, action.memory_bytes or 0, action.reason)
        throttled.pop(action.slot_id, None)
    actions += evictions
    calm = (
        not evictions
        and used_pct < calm_below
        and (pressure is None or pressure < config.memory_pressure_threshold / 2)
    )
    calm_since = (state.calm_since if state.calm_since is not None else sample.time) if calm else None
    last_restore = state.last_restore
    if calm and evicted and calm_since is not None:
        restore = _restore(config, sample, evicted, used, calm_since=calm_since, last_restore=last_restore)
        if restore is not None:
            actions.append(restore)
            assert restore.slot_id is not None
            del evicted[restore.slot_id]
            last_restore = sample.time
    return replace(
        state, throttled=throttled, evicted=evicted, calm_since=calm_since, last_restore=last_restore
    ), actions


def _evictions(
    config: ColocationConfig,
    sample: Sample,
    evicted: Mapping[str, Eviction],
    used_pct: float,
    pressure: float | None,
) -> list[Action]:
    by_memory = used_pct >= config.memory_evict_percent
    by_pressure = pressure is not None and pressure >= config.memory_pressure_threshold
    if not (by_memory or by_pressure):
        return []
    candidates = sorted(
        (s for s in sample.best_effort if s.running and not s.evicted and s.slot_id not in evicted),
        key=lambda s: (s.priority, -s.started_at, s.slot_id),
    )
    total = sample.memory_total
    projected = used_pct
    chosen: list[Action] = []
    for slot in candidates:
        if by_memory and projected < config.memory_evict_target_percent:
            break
        if not by_memory and chosen:
            break  # pressure cannot be projected: one per period, then look again
        size = slot.usage.memory_bytes or 0
        reason = (
            f"node memory {used_pct:.0f}% used (evict at {config.memory_evict_percent:g}%, down to "
            f"{config.memory_evict_target_percent:g}%)"
            if by_memory
            else f"online memory pressure {pressure:.0%} of the period (threshold "
            f"{config.memory_pressure_threshold:.0%})"
        )
        chosen.append(
            Action(
                "evict",
                slot.slot_id,
                f"{reason}; priority {slot.priority}, lowest and youngest go first",
                memory_bytes=size,
            )
        )
        projected -= 100.0 * size / total
    return chosen


def _restore(
    config: ColocationConfig,
    sample: Sample,
    evicted: Mapping[str, Eviction],
    used: int,
    *,
    calm_since: float,
    last_restore: float | None,
) -> Action | None:
    now = sample.time
    if now - calm_since < config.restore_after_seconds:
        return None
    if last_restore is not None and now - last_restore < config.restore_after_seconds:
        return None
    slots = {s.slot_id: s for s in sample.best_effort}
    limit = sample.memory_total * (config.memory_throttle_percent - MEMORY_HYSTERESIS_POINTS) / 100
    # Highest priority first, then in the order they were evicted (within a period: youngest first).
    order = sorted(
        evicted.items(), key=lambda kv: (-slots[kv[0]].priority, kv[1].at, -slots[kv[0]].started_at)
    )
    for slot_id, eviction in order:
        if used + eviction.memory_bytes < limit:
            return Action(
                "restore",
                slot_id,
                f"memory calm for {now - calm_since:.0f}s and its last size fits below "
                f"{config.memory_throttle_percent - MEMORY_HYSTERESIS_POINTS:g}%: worker started again",
                memory_bytes=eviction.memory_bytes,
            )
    return None


# --------------------------------------------------------------------------- batch capacity


def _append_window(config: ColocationConfig, state: LoopState, sample: Sample, rates: _Rates) -> LoopState:
    online_memory = sum(g.memory_bytes or 0 for g in sample.online.values())
    horizon = sample.time - config.batch_window_seconds
    kept = tuple(p for p in state.window if p.time >= horizon)
    window = (*kept, WindowPoint(sample.time, rates.online_cpu, online_memory))
    return replace(state, window=window)


def _batch(config: ColocationConfig, state: LoopState, sample: Sample, rates: _Rates) -> Batch:
    window = state.window
    cpu_peak = max(p.online_cpu for p in window)
    memory_peak = max(p.online_memory for p in window)
    online_memory = window[-1].online_memory
    if sample.slots_read or sample.best_effort_memory_bytes is None:
        best_effort_memory = sum(s.usage.memory_bytes or 0 for s in sample.best_effort)
    else:
        best_effort_memory = sample.best_effort_memory_bytes
    margin = sample.memory_total * (1 - config.memory_throttle_percent / 100)
    memory = sample.memory_available + best_effort_memory - margin - max(0, memory_peak - online_memory)
    return Batch(
        cpus=max(0.0, len(sample.pool) * (1 - config.cpu_margin) - cpu_peak),
        memory_bytes=max(0, int(memory)),
        window_seconds=window[-1].time - window[0].time,
        online_cpu_peak=cpu_peak,
        online_memory_peak=memory_peak,
        best_effort_cpu=rates.best_effort_cpu,
        best_effort_memory=best_effort_memory,
    )


def actions_by_slot(actions: Iterable[Action], best_effort: Iterable[str]) -> dict[str, list[Action]]:
    """Each action under the slots it touched: class-wide ones under every best-effort slot."""
    slots = list(best_effort)
    found: dict[str, list[Action]] = {}
    for action in actions:
        for slot_id in slots if action.slot_id is None else [action.slot_id]:
            found.setdefault(slot_id, []).append(action)
    return found


__all__ = [
    "ACTION_KINDS",
    "BURSTABLE_GROUP",
    "SLOT_DETAIL_EVERY",
    "Action",
    "ActionKind",
    "Batch",
    "BestEffortSlot",
    "ColocationConfig",
    "CpuLimit",
    "Decision",
    "Eviction",
    "GroupUsage",
    "LoopState",
    "Measured",
    "Sample",
    "Stall",
    "actions_by_slot",
    "choose_cpus",
    "decide",
    "needs_slot_detail",
]
