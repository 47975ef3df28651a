"""tools/predict.py's pieces: the workload and memory (workload.py), the layout search and
report (report.py), the checks against measured points (validate.py) and the paper's grid
(paper.py)."""
