from git_theta.commands.cli import entry

entry()
