"""Backtests: replay a market trace and a request workload through the real placement,
lease book and failover code on a simulated clock, and compare placement strategies.

    market.py      the market: a trace file or the simulated market, in steps
    draws.py       the interruption draws every strategy shares
    private.py     a private pool added to the market
    workload.py    the requests: a JSON Lines file (validated as the daemon validates) or
                   a generated, seeded mix
    strategies.py  on_demand, cheapest_spot, price_capacity, gpubroker
    ledger.py      a run's settings, jobs, tally of work and money, and strategy's view
    engine.py      one strategy's run: events on a simulated clock
    compare.py     every strategy on the same simulation (with a private pool: cloud
                   only and with the pool); JSON
    report.py      the tables; chart.py the PNG chart

Its command line, `gpubroker backtest`, is broker/cli/backtest.py.
"""

STRATEGIES = ("on_demand", "cheapest_spot", "price_capacity", "gpubroker")
"""The strategies a backtest can compare, in the order reports list them."""
