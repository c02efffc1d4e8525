"""What people and operators' files may hand the program, checked before anything uses it:
``suppliers.yaml`` read strictly (:mod:`.config_yaml`), cron expressions (:mod:`.cron`), ids and
JSON from the command line and launchpad forms (:mod:`.operator_input`), and the characters a
recorded ``--by``/``--reason`` may hold and how stored text is shown (:mod:`.text`)."""
