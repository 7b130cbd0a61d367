"""What every layer shares: the errors a user is shown (`common.errors`), safe output files (`paths`)."""
