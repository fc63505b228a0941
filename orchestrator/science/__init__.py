"""What the finished trials show: learning rates chosen on validation (``analysis``), brackets
that adapt (``brackets``), an experiment's results (``results``), power-law fits
(``scaling``), the claims (``claims``), their statistics (``verdicts``) and reports
(``report``). Reads the records; launches nothing."""
