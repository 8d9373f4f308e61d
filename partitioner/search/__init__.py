"""The planners: layer graph + cluster -> Plan, each priced by the root's cost model and simulator.

``solve`` (solve.py) is the front door: chains go to the chain planners (chain.py: the bottleneck DP,
the threshold search, the local search), other graphs to CP-SAT (cpsat.py), in two levels above a size
(multilevel.py, coarsen.py), from the legal starts of starts.py and baselines.py, over the device orders
of order.py, refined on the step (refine.py); ``choose`` (choose.py) picks M and the schedule. Nothing
at the root of ``partitioner`` imports this package (docs/architecture.md, "Floors").
"""
