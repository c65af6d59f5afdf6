"""HTML reports of runs, diffs, bisects, matrices and CI corpus runs: one
self-contained file each, drawn with a vendored charting library (Plotly,
assets/plotly-LICENSE.txt), and the pages the dashboard serves."""
