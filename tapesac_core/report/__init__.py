"""What a run tells its user: the run report read back from logs (``report``) and its figures
(``figures``).

Imports every layer below it; nothing imports it but the integrations and the CLI.
"""
