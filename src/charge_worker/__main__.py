from charge_worker.cli import main

main(prog_name="charge-worker")
