"""What every layer shares, below the configuration: the errors a user is shown (`common.errors`)
and the safety of output files (`common.paths`)."""
