"""Output: a plan as tables (report.py) and its simulated schedule as a timeline (timeline.py).

Reads plans and simulations; neither the root of ``partitioner`` nor its planners import it.
"""
