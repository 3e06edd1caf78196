<#
Install a built HiveJet installer silently into a temporary folder, check the installed copy, uninstall it:
  pwsh installer/windows/smoke.ps1 -Installer dist\HiveJet-0.1.0-setup.exe
Checks: `hivejet.cmd --version`, the app's offscreen smoke test through the Start menu command
(`pythonw -m app.firstrun launch --smoke`, run with python.exe to see its output), the shortcuts and the
uninstall registry entry, the app-local VC++ runtime DLLs; an upgrade while HiveJet runs (a silent one gives up
and leaves the installed version whole and working), then one after it closed; after the silent uninstall,
that the program and shortcuts are gone and that user data was kept (a silent uninstall keeps models and
conversations).
#>
param([Parameter(Mandatory = $true)][string]$Installer)
$ErrorActionPreference = "Stop"
function Assert([bool]$Cond, [string]$What) { if (-not $Cond) { throw "FAILED: $What" } else { Write-Host "ok: $What" } }

$dir = Join-Path $env:RUNNER_TEMP "hivejet-smoke"
if (-not $env:RUNNER_TEMP) { $dir = Join-Path $env:TEMP "hivejet-smoke" }
$p = Start-Process -FilePath $Installer -ArgumentList "/S", "/D=$dir" -Wait -PassThru
Assert ($p.ExitCode -eq 0) "silent install exits 0"
Assert (Test-Path "$dir\python\pythonw.exe") "python installed in $dir"
Assert (Test-Path "$env:APPDATA\Microsoft\Windows\Start Menu\Programs\HiveJet.lnk") "Start menu shortcut"
Assert (Test-Path ([Environment]::GetFolderPath("Desktop") + "\HiveJet.lnk")) "desktop shortcut"
Assert ((Get-ItemProperty "HKCU:\Software\Microsoft\Windows\CurrentVersion\Uninstall\HiveJet").InstallLocation -eq $dir) "uninstall entry"

foreach ($dll in "msvcp140.dll", "msvcp140_atomic_wait.dll", "vcruntime140.dll", "vcruntime140_1.dll", "vcruntime140_threads.dll") {
  Assert (Test-Path "$dir\python\$dll") "VC++ runtime $dll beside python.exe"
}
$out = & "$dir\hivejet.cmd" --version
Assert ($LASTEXITCODE -eq 0 -and "$out" -match "^hivejet ") "hivejet --version: $out"

$env:QT_QPA_PLATFORM = "offscreen"
$env:HIVEJET_HOME = Join-Path $env:TEMP "hivejet-smoke-home"
$env:HIVEJET_MODELS = Join-Path $env:HIVEJET_HOME "models"
$ErrorActionPreference = "Continue"   # the app's stderr lines are not errors
$out = & "$dir\python\python.exe" -m app.firstrun launch --smoke 2>&1 | ForEach-Object { "$_" }
$ErrorActionPreference = "Stop"
Write-Host ($out -join "`n")
Assert ($LASTEXITCODE -eq 0 -and ($out -join " ") -match "smoke ok") "offscreen smoke test of the installed app"
$plan = & "$dir\python\python.exe" -m app.firstrun plan
Write-Host "first-run plan: $plan"

# Upgrade while HiveJet runs (a python.exe from the install holds its files open): a silent install gives up
# and changes nothing; the installed copy still runs.
$running = Start-Process -FilePath "$dir\python\python.exe" -ArgumentList "-c", "import time, torch; time.sleep(600)" -PassThru
Start-Sleep -Seconds 10
$p = Start-Process -FilePath $Installer -ArgumentList "/S" -Wait -PassThru
Assert ($p.ExitCode -ne 0) "silent upgrade while HiveJet runs gives up (exit $($p.ExitCode))"
Assert (-not (Test-Path "$dir\python.new") -and -not (Test-Path "$dir\python.old")) "no half-made tree left"
$out = & "$dir\hivejet.cmd" --version
Assert ($LASTEXITCODE -eq 0 -and "$out" -match "^hivejet ") "the installed copy still runs: $out"
Stop-Process -Id $running.Id -Force
$running.WaitForExit()

# Upgrade in place once it closed: installing again over the same folder keeps working.
$p = Start-Process -FilePath $Installer -ArgumentList "/S" -Wait -PassThru
Assert ($p.ExitCode -eq 0 -and (Test-Path "$dir\python\pythonw.exe")) "reinstall (upgrade in place) into $dir"
Assert (-not (Test-Path "$dir\python.new") -and -not (Test-Path "$dir\python.old")) "the swap left no old or new tree"
$out = & "$dir\hivejet.cmd" --version
Assert ($LASTEXITCODE -eq 0) "the upgraded copy runs: $out"

New-Item -ItemType Directory -Force "$env:LOCALAPPDATA\hivejet\hivejet" | Out-Null
Set-Content "$env:LOCALAPPDATA\hivejet\hivejet\keep.txt" "user data"
$p = Start-Process -FilePath "$dir\Uninstall.exe" -ArgumentList "/S", "_?=$dir" -Wait -PassThru
Assert ($p.ExitCode -eq 0) "silent uninstall exits 0"
Assert (-not (Test-Path "$dir\python")) "program removed"
Assert (-not (Test-Path "$env:APPDATA\Microsoft\Windows\Start Menu\Programs\HiveJet.lnk")) "Start menu shortcut removed"
Assert (Test-Path "$env:LOCALAPPDATA\hivejet\hivejet\keep.txt") "user data kept by a silent uninstall"
Remove-Item -Recurse -Force $dir, "$env:LOCALAPPDATA\hivejet" -ErrorAction SilentlyContinue
