"""The ground floor every room stands on: errors and their one-line messages (errors), safe names
(names), typed parameter classes and their checks (spec), the options records of every verb
(options), the process's runtime settings (runtime), logging (logs), the user's config file
(config), and torch imported only when first used (lazy). It imports nothing of mmkv_cli above
it."""
