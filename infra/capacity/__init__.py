"""The capacity and cost plan: what a model replica holds and costs, computed before anything is deployed.

geometry.py     a model's shape (the `geometry` block, or the pinned table of the README's model families)
plan.py         one replica under vLLM's memory rules: weights, KV cache, blocks, tokens, sequences
calibration.py  what CUDA reports per GPU and published vLLM start-ups: the non-KV memory as a band
kv_band.py      a replica's KV tokens between the band's ends (the plan's figure lies inside)
workload.py     a model's workload profile: the sequences a replica runs at once without preemption at it
cost.py         the pinned prices (prices.py), a memory-bandwidth roofline for decode at the workload, $ per 1M tokens
rules.py        the config rules the plan enforces (called from infra/config/models.py)
inputs.py       what the plan reads of a stack, built by the config (infra/config/capacity_plan.py)
report.py       the plan of a whole stack: the table, the Markdown, the preview lines, the stack output

Nothing here imports vLLM: the rules are vLLM 0.29's, written out, and the
tests hold them to vLLM's own code. Nothing here imports the config either:
the config calls down into this package, and hands the plan plain values.
"""
