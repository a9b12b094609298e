"""parallel-twins' command line: compare.py's parser and subcommands (cli), the shared options and
output paths (args), the runs (runs), the reports (report, report_collectives), the figures (plots,
plots_layouts, plot_style), bench, plan (planner), checkpoint (checkpoint_matrix) and doctor."""
