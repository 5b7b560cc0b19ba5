"""The scheduler: which sequences compute which tokens each step, split by phase.

- `scheduler.Scheduler`: the queues (waiting, running), the step's plan phase by phase, preemption, forks;
- `plan`: the records a step is planned in (Chunk, Failure, StepPlan, Waiting) and the Proposer type;
- `tier_loads.TierLoads`: admission's tier phase (prompts that continue into a tier wait for their load);
- `pins`: admission's pin phase (what pins must leave unpinned, and the refusal when they do not);
- `allocation.Pages`: admission's allocation phase and every page the scheduler takes (leases, copies, forks);
- `drafts.add_drafts`: the step's room for speculative drafts.
"""

from radixcache.worker.engine.scheduler.plan import Chunk, Failure, Proposer, StepPlan, Waiting
from radixcache.worker.engine.scheduler.scheduler import Scheduler

__all__ = ["Chunk", "Failure", "Proposer", "Scheduler", "StepPlan", "Waiting"]
