"""The forms a person fills in, as pydantic models: a run file (`run`, its data sections in `run_data`), a study
file (`study`), a serve file (`serve`), and the command line's overrides of a run file (`overrides`). They are the
Prefect UI's forms and the TOML files' schema; the flows beside this package read them and act."""
