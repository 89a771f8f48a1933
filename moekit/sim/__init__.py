"""The routing / load-balancing simulator: the lesson's "Try it" page, on moekit's own routing.

    synthetic router (skew) -> balancing (aux-loss | bias) -> moekit.route -> capacity -> loads, drops
      -> experts touched per batch -> parameters -> expert-parallel what-if

``simulate(SimParams(...)) -> SimResult``; ``moekit.sim.exercises`` answers the lesson's exercises;
``moekit.sim.server`` serves the page (imported only by the CLI).
"""

from moekit.sim.params import BALANCE_METHODS, LIMITS, SimParams
from moekit.sim.run import BalanceReport, SimResult, TouchPoint, simulate

__all__ = ["BALANCE_METHODS", "LIMITS", "SimParams", "SimResult", "BalanceReport", "TouchPoint", "simulate"]
