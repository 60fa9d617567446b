"""sparrow's lab: benchmarks (`sparrow bench NAME`), the long-context evaluation behind them, and
tooling for tests and scripts (kernel IR compiled for other CPUs). It sits beside the engine
package and imports it; `sparrow` never imports the lab, except the CLI, which loads a benchmark
by name when `sparrow bench` runs. Installed with sparrow from its repository; its own extra
dependencies (matplotlib, for the plots) come with `pip install -e '.[lab]'`.
"""
