"""A deployment's graph: its schema (`schema.py`; the shipped ones: `shipped.py`), the one plan
every site runs (`plan.py`: typed facts per component and replica), each replica's command line
rendered from it last (`argv.py`), and the generated checkpoint (`checkpoint.py`)."""
