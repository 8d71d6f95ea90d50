"""One model's queue and who serves next: the executor, its fair queue, replica choice, the job."""
