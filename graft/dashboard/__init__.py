"""`graft dashboard`: a namespace's PatchRollouts and PatchFleets, live in the browser.

cli (the command and its flags) -> server (the Starlette application) -> bridge (one list-then-watch
per collection, every change pushed to each open page as server-sent events) -> cluster (the
Kubernetes calls, with the user's credentials) and views (what the page shows of an object);
static/ holds the page, its script and the charting library (uPlot, MIT, vendored: the page fetches
nothing from elsewhere). Above graft.operator (it reuses the CLI's verbs and the terminal's wording),
never importing graft.engine or graft.devcluster.
"""
