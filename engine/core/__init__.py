"""The host-side core, plain Python over ints (never imports torch or the worker): requests and their kinds;
sched/ (the scheduler, preemption, the step's plan and how results update sequences); kv/ (block pool,
allocator, swap space, the KV tiers' store); admission_rules/ (every rule that refuses a request)."""
