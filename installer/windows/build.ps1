<#
Build HiveJet's Windows installer:   pwsh installer/windows/build.ps1 [-Out dist] [-PythonVersion 3.12.10]

1. builds the project's wheel (with the Python on PATH);
2. takes python.org's CPython for Windows from its NuGet package (a plain folder: no installer, no registry);
3. installs HiveJet and its dependencies into it, torch pinned to the CPU build of app/gpu_stack.json (PyTorch's
   Windows build on PyPI is the CPU build), so the installed app always works, offline, in CPU mode; the CUDA
   build is downloaded on the first start when there is a suitable NVIDIA GPU (app/firstrun.py);
4. copies the Microsoft Visual C++ runtime DLLs (MSVCP140*.dll, VCRUNTIME140*.dll, CONCRT140.dll) from Visual
   Studio's redistributable folder into python\, beside python.exe: torch and Triton load them, a clean Windows
   does not have them, and app-local DLLs need neither administrator rights nor vc_redist's own installer
   (Microsoft's "app-local deployment"). No Visual Studio (its C++ tools) on the build machine stops the build;
5. adds the icon and hivejet.cmd, and compiles installer/windows/hivejet.nsi with makensis
   (NSIS: preinstalled on GitHub's Windows runners, else installed with Chocolatey).
Writes <Out>/HiveJet-<version>-setup.exe and prints its path.
#>
param(
  [string]$Out = "dist",
  [string]$PythonVersion = "3.12.10",
  [string]$Wheel = ""
)
$ErrorActionPreference = "Stop"
$ProgressPreference = "SilentlyContinue"   # Invoke-WebRequest is very slow with its progress bar

# Runs a native command and stops on a non-zero exit code. A simple function (no param block), so that
# arguments such as -m reach the command instead of being taken as PowerShell parameters.
function Invoke-Checked {
  $exe, $rest = $args
  & $exe @rest
  if ($LASTEXITCODE -ne 0) { throw "$exe $($rest -join ' ') failed with exit code $LASTEXITCODE" }
}

$repo = (Resolve-Path "$PSScriptRoot\..\..").Path
$work = Join-Path $repo "build\windows-installer"
if (Test-Path $work) { Remove-Item -Recurse -Force $work }
$payload = Join-Path $work "payload"
New-Item -ItemType Directory -Force $payload | Out-Null
New-Item -ItemType Directory -Force $Out | Out-Null
$Out = (Resolve-Path $Out).Path

# 1. The wheel.
if (-not $Wheel) {
  Invoke-Checked python -m pip wheel --no-deps -w "$work\wheel" $repo
  $Wheel = (Get-ChildItem "$work\wheel\hivejet-*.whl" | Select-Object -First 1).FullName
}
$version = (Split-Path $Wheel -Leaf).Split("-")[1]
$numeric = ($version -replace '[^0-9.].*$', '').TrimEnd('.')
$parts = @($numeric.Split(".") | Where-Object { $_ -ne "" })
while ($parts.Count -lt 4) { $parts += "0" }
$viVersion = ($parts[0..3] -join ".")
Write-Host "HiveJet $version (file version $viVersion)"

# 2. Python from python.org's NuGet package.
Invoke-WebRequest "https://www.nuget.org/api/v2/package/python/$PythonVersion" -OutFile "$work\python.zip"
Expand-Archive "$work\python.zip" "$work\nuget"
Move-Item "$work\nuget\tools" "$payload\python"
$py = "$payload\python\python.exe"
& $py -m pip --version
if ($LASTEXITCODE -ne 0) { Invoke-Checked $py -m ensurepip --upgrade }
Invoke-Checked $py -m pip install --disable-pip-version-check --no-warn-script-location --upgrade "pip>=24.1"

# 3. HiveJet and its dependencies (torch: the pinned CPU build, PyPI's Windows wheel).
$stack = Get-Content -Raw "$repo\app\gpu_stack.json" | ConvertFrom-Json
$torchSpec = "torch==$($stack.cpu.win32.torch)"
Invoke-Checked $py -m pip install --disable-pip-version-check --no-warn-script-location --no-cache-dir $Wheel $torchSpec

# 4. The VC++ runtime, app-local (see above). vswhere ships with every Visual Studio installation.
$vswhere = Join-Path ${env:ProgramFiles(x86)} "Microsoft Visual Studio\Installer\vswhere.exe"
if (-not (Test-Path $vswhere)) { throw "Visual Studio is missing: its VC++ redistributable DLLs are needed (see build.ps1)" }
$vs = & $vswhere -latest -products * -requires Microsoft.VisualStudio.Component.VC.Tools.x86.x64 -property installationPath
$crt = Get-ChildItem "$vs\VC\Redist\MSVC\*\x64\Microsoft.VC14*.CRT" -Directory -ErrorAction SilentlyContinue |
  Sort-Object FullName | Select-Object -Last 1
if (-not $crt) { throw "no VC++ redistributable folder (VC\Redist\MSVC\*\x64\Microsoft.VC14*.CRT) under $vs" }
Write-Host "VC++ runtime from $($crt.FullName)"
Copy-Item "$($crt.FullName)\*.dll" "$payload\python\" -Force
foreach ($dll in "msvcp140.dll", "msvcp140_atomic_wait.dll", "vcruntime140.dll", "vcruntime140_1.dll", "vcruntime140_threads.dll") {
  if (-not (Test-Path "$payload\python\$dll")) { throw "$dll is missing from $($crt.FullName)" }
}
Invoke-Checked $py -c "import app, torch, PySide6; print('hivejet', app.__version__, 'torch', torch.__version__)"

# 5. Icon, command-line launcher, readme.
Copy-Item "$repo\resources\icons\hivejet.ico" "$payload\hivejet.ico"
Set-Content -Encoding ascii "$payload\hivejet.cmd" "@`"%~dp0python\python.exe`" -m app.cli %*"
Set-Content -Encoding utf8 "$payload\README.txt" @"
HiveJet $version

Start HiveJet from the Start menu. hivejet.cmd in this folder is the command line (hivejet.cmd --help).
Models and conversations are in %LOCALAPPDATA%\hivejet. See docs/INSTALL.md in the HiveJet repository.
"@

# 6. makensis.
$makensis = (Get-Command makensis -ErrorAction SilentlyContinue).Source
if (-not $makensis) {
  $candidate = Join-Path ${env:ProgramFiles(x86)} "NSIS\makensis.exe"
  if (-not (Test-Path $candidate)) { Invoke-Checked choco install nsis -y --no-progress }
  $makensis = $candidate
}
$exe = Join-Path $Out "HiveJet-$version-setup.exe"
Invoke-Checked $makensis -V2 "-DVERSION=$version" "-DVIVERSION=$viVersion" "-DPAYLOAD=$payload" "-DOUTFILE=$exe" "$PSScriptRoot\hivejet.nsi"
Write-Host ("{0} ({1:N0} MB)" -f $exe, ((Get-Item $exe).Length / 1MB))
Write-Output $exe
