"""The suite's processes pace the garbage collector as the command line does
(``hetplan.collector``): the searches under test build the same memo tables."""

from hetplan.collector import pace_collector

pace_collector()
