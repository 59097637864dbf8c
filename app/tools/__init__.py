"""The headless tools: the ``staged-chat`` command line, the benchmark and its peers. No Qt.

The one exception is the benchmark's ``--chart``, drawn by ``app.ui.bench_chart`` and imported
only when a chart is asked for.
"""
